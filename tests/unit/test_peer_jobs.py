"""The jobs a service has joined for peer replicas (daemon/server/replicas.py), without a
service: every restore of a many-rank job joins a job of its own, so the record is
bounded per root to the newest job that writes (its shares go out) and the newest that
restores, and a restore that joined last does not take the writer's replicas away."""

from __future__ import annotations

from checkpointd.daemon.server.memtier import root_key
from checkpointd.daemon.server.replicas import Replicas
from checkpointd.daemon.wire import protocol as p

SERVICES = [p.PeerService("a", "127.0.0.1:1", [0]), p.PeerService("b", "127.0.0.1:2", [1])]


def _join(replicas: Replicas, root: str, job: str, count: int, rank: int = 0) -> None:
    message = p.JoinPeers(
        id=1,
        root=root,
        storage_options=None,
        job=job,
        key=job.encode().ljust(32, b"k"),
        ranks=[rank],
        replicas=count,
        services=SERVICES,
    )
    replicas.join(root_key(root, None), message)


def test_the_jobs_joined_are_bounded_per_root_and_a_restore_keeps_the_writers() -> None:
    replicas = Replicas(1, lambda segment: None)
    _join(replicas, "/tmp/peer-jobs-a", "writer-1", 1)
    _join(replicas, "/tmp/peer-jobs-b", "other-root", 1)
    for number in range(50):  # a job that restores again and again (evaluations, say)
        _join(replicas, "/tmp/peer-jobs-a", f"restore-{number}", 0)
    assert list(replicas.jobs) == ["writer-1", "other-root", "restore-49"]
    key = root_key("/tmp/peer-jobs-a", None)
    restoring, writing = replicas.job_for(key), replicas.job_for(key, writing=True)
    assert restoring is not None
    assert restoring.job == "restore-49"  # a fetch uses the services that restore now
    assert writing is not None
    assert writing.job == "writer-1"  # the writer's shares still go out
    # the job restarted: its new writer replaces the old one
    _join(replicas, "/tmp/peer-jobs-a", "writer-2", 1)
    assert list(replicas.jobs) == ["other-root", "restore-49", "writer-2"]
    # another local rank of the same job extends it, replacing nothing
    _join(replicas, "/tmp/peer-jobs-a", "writer-2", 1, rank=1)
    assert list(replicas.jobs) == ["other-root", "restore-49", "writer-2"]
    assert replicas.jobs["writer-2"].ranks == {0, 1}
