"""Peer replicas of the memory tier: real 3-rank gloo FSDP2 jobs, each rank on a "node"
of its own (a real ``checkpointd serve`` with ``--peer-address 127.0.0.1``, real TCP),
saving with ``replicas=1``: each rank's held share also goes to the next node's service.
Losing a node is SIGKILL of its service (the trainers have exited) and a new, empty
service in its place; the restarted rank's service fetches its share from the peer that
holds it (not one shard byte read from storage), and the restore is bit for bit the
saved state. Two nodes lost with ``replicas=1``: the rank whose replica died with the
other node reads storage, the other its peer's copy. A damaged replica is never used.
Resharded (4 ranks on 2 nodes restored on 3), HSDP and TP restores take each other saved
rank's shards from the node or peer that holds that share, fetched only where read.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from checkpointd.daemon.client.client import status
from tests.integration.test_sharded import check_restored, job
from tests.support.service import (
    Service,
    damage_held_copy,
    run_python,
    services_per_rank,
    socket_folder,
    start_service,
)

WORLD = 3
PEERS = ("--peer-address", "127.0.0.1")

pytestmark = pytest.mark.timeout(400)


def _replicated(services: list[Service], count: int) -> None:
    """Wait until no save is in flight and every service holds ``count`` replicas."""
    deadline = time.monotonic() + 60
    while True:
        replies = [status(s.socket) for s in services]
        if all(not r.saves_in_flight and r.replicas_held == count for r in replies):
            return
        assert time.monotonic() < deadline, [s.log_text()[-3000:] for s in services]
        time.sleep(0.05)


def _reports(out: Path) -> list[dict[str, object]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _save(root: str, out: Path, services: list[Service], kind: str = "fsdp2") -> None:
    """Step 1 of a ``kind`` job, one rank per service, saved with replicas=1."""
    sockets = ",".join(s.socket for s in services)
    job(
        "save",
        kind,
        root,
        out,
        len(services),
        CHECKPOINTD_TEST_SERVICES=sockets,
        CHECKPOINTD_TEST_REPLICAS="1",
    )


def _restore(root: str, out: Path, services: list[Service]) -> list[dict[str, object]]:
    sockets = ",".join(s.socket for s in services)
    job("restore", "fsdp2", root, out, WORLD, CHECKPOINTD_TEST_SERVICES=sockets)
    return _reports(out)


def _lose(services: list[Service], node: int, fresh: list[Service]) -> None:
    """SIGKILL node ``node``'s service; a new empty one takes its place (kept in
    ``fresh``, for the caller to stop)."""
    services[node].kill()
    services[node] = start_service(socket_folder(), *PEERS)
    fresh.append(services[node])


@contextlib.contextmanager
def _lost(services: list[Service], *nodes: int) -> Iterator[None]:
    """Nodes ``nodes`` lost (``_lose``) for the block; their replacements stopped after."""
    fresh: list[Service] = []
    try:
        for node in nodes:
            _lose(services, node, fresh)
        yield
    finally:
        for service in fresh:
            service.stop()


_FRESH: list[Service] = []  # the module's replacement services, stopped with ``saved``


@pytest.fixture(scope="module")
def saved(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, Path, list[Service]]]:
    """Step 1 of an FSDP2 job of 3 ranks, one node each, saved with replicas=1: (root,
    the save's output folder, the services, which tests may replace)."""
    base = tmp_path_factory.mktemp("peers")
    root = str(base / "root")
    with services_per_rank(WORLD, args=PEERS) as services:
        _save(root, base / "save", services)
        _replicated(services, 1)
        nodes = list(services)
        try:
            yield root, base / "save", nodes
        finally:
            while _FRESH:
                _FRESH.pop().stop()


def test_each_share_goes_to_the_next_node_and_status_counts_it(
    saved: tuple[str, Path, list[Service]],
) -> None:
    _, _, services = saved
    replies = [status(s.socket) for s in services]
    assert [r.replicas_sent for r in replies] == [1, 1, 1]
    assert all(r.replica_bytes_sent > 0 for r in replies)
    assert all(r.replica_failures == {} for r in replies)
    assert len({r.service for r in replies}) == WORLD
    shown = run_python(
        "-m", "checkpointd", "status", "--socket", services[0].socket, "--json", check=True
    )
    fields = json.loads(shown.stdout)
    host, port = fields["peer_address"].rsplit(":", 1)
    assert host == "127.0.0.1"
    assert int(port) > 0
    assert fields["replicas_held"] == 1


def test_a_lost_node_restores_its_rank_from_a_peer_bit_exact(
    saved: tuple[str, Path, list[Service]], tmp_path: Path
) -> None:
    root, save, services = saved
    _lose(services, 1, _FRESH)
    reports = _restore(root, tmp_path / "r", services)
    # not one byte of a shard file from storage: rank 1's share came from node 2's memory
    assert [r["shard_bytes_read"] for r in reports] == [0, 0, 0]
    assert [r["source"] for r in reports] == ["memory", "peer", "memory"]
    assert status(services[1].socket).replicas_held == 1  # fetched, held from now on
    check_restored(save, tmp_path / "r")


def test_two_nodes_lost_with_one_replica_reads_storage_only_where_none_is_left(
    saved: tuple[str, Path, list[Service]], tmp_path: Path
) -> None:
    root, save, services = saved
    _lose(services, 1, _FRESH)  # rank 1's replica (on node 2) dies next
    _lose(services, 2, _FRESH)  # rank 2's replica lives on node 0
    reports = _restore(root, tmp_path / "r", services)
    read = [r["shard_bytes_read"] for r in reports]
    assert read[0] == 0
    assert read[1] > 0  # no copy of rank 1's share is left in any memory
    assert read[2] == 0  # node 0 held rank 2's
    assert [r["source"] for r in reports] == ["memory", "storage", "peer"]
    check_restored(save, tmp_path / "r")


def test_a_damaged_replica_is_never_used(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    with services_per_rank(WORLD, args=PEERS) as services:
        _save(root, tmp_path / "save", services)
        _replicated(services, 1)
        # node 2 holds rank 1's replica: flip a byte of every segment it has there
        damage_held_copy(services[2].proc.pid, services[2].socket, root, 1)
        with _lost(services, 1):
            reports = _restore(root, tmp_path / "r", services)
    assert reports[1]["source"] == "storage"  # the fetched copy failed its check
    check_restored(tmp_path / "save", tmp_path / "r")


def test_a_replica_that_does_not_fit_the_memory_limit_is_dropped_not_the_own_step(
    tmp_path: Path,
) -> None:
    root = str(tmp_path / "root")
    # room for a node's own share of the step (3 pages of 4 KiB) and not for a replica
    limit = ("--memory-limit", str(5 * 4096))
    with services_per_rank(WORLD, args=[*PEERS, *limit]) as services:
        _save(root, tmp_path / "save", services)
        deadline = time.monotonic() + 60
        while not all(status(s.socket).replica_failures for s in services):
            assert time.monotonic() < deadline, [status(s.socket) for s in services]
            time.sleep(0.05)
        replies = [status(s.socket) for s in services]
    for reply in replies:
        assert reply.replicas_held == 0
        assert reply.replicas_sent == 0
        assert reply.replica_failures == {"no memory": 1, "peer refused: no memory": 1}
        assert list(reply.kept.values()) == [[1]]  # its own step stays


def test_a_lost_node_restores_resharded_on_2_ranks_from_a_peer_and_storage(
    saved: tuple[str, Path, list[Service]], tmp_path: Path
) -> None:
    root, save, services = saved
    # The job restarts on 2 ranks: rank 0 on a replacement node (empty), rank 1 on node 0
    # (never replaced in this module: it holds saved rank 0's share and, as a replica,
    # saved rank 2's). Rows over 2 ranks straddle the 3 saved shares: the new rank 0
    # fetches saved rank 0's share from node 0 and reads saved rank 1's rows from
    # storage (no service of this job holds that share); the new rank 1 is offered node
    # 0's own share (saved rank 0's), of which only files every rank holds alike serve
    # it, reads saved rank 2's rows from node 0's replica and saved rank 1's from
    # storage. Each file is checked against storage's manifest, so none that a rank's
    # share holds under another world size is ever taken for another.
    fresh = start_service(socket_folder(), *PEERS)
    _FRESH.append(fresh)
    sockets = ",".join([fresh.socket, services[0].socket])
    job("restore", "fsdp2", root, tmp_path / "r", 2, CHECKPOINTD_TEST_SERVICES=sockets)
    reports = [json.loads((tmp_path / "r" / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["source"] for r in reports] == ["peer+storage", "memory+peer+storage"]
    assert all(int(str(r["shard_bytes_read"])) > 0 for r in reports)
    assert status(fresh.socket).replicas_held == 1  # saved rank 0's share, fetched
    check_restored(save, tmp_path / "r")


def test_a_tp_job_of_2_nodes_restores_the_lost_nodes_rank_from_its_peer(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    with services_per_rank(2, args=PEERS) as services:
        _save(root, tmp_path / "save", services, "tp")
        _replicated(services, 1)
        with _lost(services, 0):  # rank 0's share lives on node 1 too
            sockets = ",".join(s.socket for s in services)
            job("restore", "tp", root, tmp_path / "r", 2, CHECKPOINTD_TEST_SERVICES=sockets)
    reports = [json.loads((tmp_path / "r" / f"rank{r}.json").read_text()) for r in range(2)]
    # each TP rank reads back a few bytes of the other rank's files (80 and 40 here): the
    # lost node's rank takes both shares from node 1 (its own, then the other rank's),
    # the live one those of the other rank from the replica it holds: none from storage
    assert [r["source"] for r in reports] == ["peer", "memory+peer"]
    assert [r["shard_bytes_read"] for r in reports] == [0, 0]
    check_restored(tmp_path / "save", tmp_path / "r")


def test_a_lost_node_of_2_restores_resharded_on_3_ranks_every_share_from_memory_or_a_peer(
    tmp_path: Path,
) -> None:
    root = str(tmp_path / "root")
    with services_per_rank(2, args=PEERS) as services:
        # 4 FSDP2 ranks on 2 nodes (ranks 0, 1 on node A; 2, 3 on node B), replicas=1:
        # each node also holds the other node's 2 shares
        a, b = (s.socket for s in services)
        job(
            "save",
            "fsdp2",
            root,
            tmp_path / "save",
            4,
            CHECKPOINTD_TEST_SERVICES=",".join([a, a, b, b]),
            CHECKPOINTD_TEST_REPLICAS="1",
        )
        _replicated(services, 2)
        with _lost(services, 0):
            # restarted on 3 ranks: new ranks 0, 1 on A's empty replacement, 2 on B.
            # Rows over 3 ranks straddle the 4 saved shares: new rank 0 reads saved ranks
            # 0's and 1's, new rank 1 saved 1's and 2's (fetched from B as it reads them),
            # new rank 2 saved 2's and 3's (B's own); no shard byte from storage, and
            # saved rank 3's share, which no rank on A reads, never crosses the network
            sockets = ",".join([services[0].socket, services[0].socket, b])
            job("restore", "fsdp2", root, tmp_path / "r", 3, CHECKPOINTD_TEST_SERVICES=sockets)
            replies = [status(s.socket) for s in services]
    reports = [json.loads((tmp_path / "r" / f"rank{r}.json").read_text()) for r in range(3)]
    assert [r["shard_bytes_read"] for r in reports] == [0, 0, 0]
    assert [r["source"] for r in reports] == ["peer", "peer", "memory"]
    assert replies[0].replicas_held == 3  # saved ranks 0, 1 and 2's shares, fetched
    assert replies[0].replica_failures == {}
    assert replies[1].replicas_held == 2  # A's 2 shares, pushed at the save
    check_restored(tmp_path / "save", tmp_path / "r")


def test_a_lost_node_of_an_hsdp_job_restores_its_own_and_its_replicas_shards_from_peers(
    tmp_path: Path,
) -> None:
    root = str(tmp_path / "root")
    with services_per_rank(4, args=PEERS) as services:
        # HSDP on a (2, 2) mesh: ranks 0 and 2 hold the same shards, as do 1 and 3, and
        # each pair shares the writing, so every rank restores files its partner wrote
        _save(root, tmp_path / "save", services, "hsdp")
        _replicated(services, 1)
        with _lost(services, 1):
            sockets = ",".join(s.socket for s in services)
            job("restore", "hsdp", root, tmp_path / "r", 4, CHECKPOINTD_TEST_SERVICES=sockets)
            replies = [status(s.socket) for s in services]
    reports = [json.loads((tmp_path / "r" / f"rank{r}.json").read_text()) for r in range(4)]
    # the lost rank's own share and its partner's from peers, every other rank's own
    # from memory and its partner's from the node that holds it: none from storage
    assert [r["shard_bytes_read"] for r in reports] == [0, 0, 0, 0]
    assert [r["source"] for r in reports] == ["memory+peer", "peer", "memory+peer", "memory+peer"]
    assert all(r.replica_failures == {} for r in replies), replies
    check_restored(tmp_path / "save", tmp_path / "r")
