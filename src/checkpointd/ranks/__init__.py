"""Many ranks, one checkpoint: the group and its heartbeats, an attempt's one
outcome, store values in chunks, a service writer's re-keyed group. The many-rank
commit, which writes a plan's files, is write/ranked_commit.py, above this."""
