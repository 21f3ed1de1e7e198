"""Many ranks, one checkpoint: the group and its heartbeats, an attempt's one
outcome, and the many-rank commit."""
