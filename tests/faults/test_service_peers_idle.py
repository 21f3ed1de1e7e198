"""A replica waits for its nodes' saves (issue 34): while a node has a save in flight, no
replica leaves it nor arrives in it, and ``status`` counts those waiting as pending; once
the save is durable they go, and both nodes hold each other's share. A push still
waiting when a newer step of its rank is held is dropped (superseded), never sent.

Two real services on 127.0.0.1, a real 2-rank FSDP2 job with ``replicas=1`` (rank 0 on
the first, rank 1 on the second), and a trainer of another root on the first service
whose save is held open before its manifest (the service's ``sync_dir`` of that root
waits for a file).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from checkpointd.daemon.client.client import status
from tests.integration.test_sharded import job
from tests.support.service import reap, socket_folder, start_service, trainer


def _until(what: str, check: object, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.timeout(240)
def test_replicas_wait_while_a_node_has_a_save_in_flight_and_go_after(tmp_path: Path) -> None:
    gate = tmp_path / "open"
    held_root = str(tmp_path / "held")
    args = ("--peer-address", "127.0.0.1")
    hold = f"sync_dir:{held_root}"
    folders = [socket_folder(), socket_folder()]
    first = start_service(folders[0], *args, gate=str(gate), hold=hold)
    second = start_service(folders[1], *args, gate=str(gate), hold=hold)
    other = None
    try:
        # the first node has a save in flight, held open before its manifest
        other = trainer(first.socket, held_root, 1)
        assert other.stdout is not None
        assert other.stdout.readline().strip() == "returned 0"
        _until("the held save in flight", lambda: status(first.socket).saves_in_flight == 1)

        root = str(tmp_path / "root")
        for step in (1, 2):
            job(
                "save",
                "fsdp2",
                root,
                tmp_path / f"save{step}",
                2,
                CHECKPOINTD_TEST_SERVICES=f"{first.socket},{second.socket}",
                CHECKPOINTD_TEST_REPLICAS="1",
                CHECKPOINTD_TEST_STEP=str(step),
            )  # committed: each node holds its own share (the newest step only)
        ours, theirs = status(first.socket), status(second.socket)
        assert ours.kept == theirs.kept == {root: [2]}
        assert ours.replicas_pending == theirs.replicas_pending == 2
        # the second node is idle: its push is under way, and waits for the first to take it
        time.sleep(2)
        ours, theirs = status(first.socket), status(second.socket)
        assert ours.saves_in_flight == 1
        assert (ours.replicas_sent, ours.replicas_held, ours.replicas_pending) == (0, 0, 2)
        assert (theirs.replicas_sent, theirs.replicas_held, theirs.replicas_pending) == (0, 0, 2)
        assert ours.replica_failures == theirs.replica_failures == {}

        gate.touch()  # the held save commits: the first node is idle, the replicas go
        _until(
            "the replicas delivered",
            lambda: (
                status(first.socket).replicas_pending == status(second.socket).replicas_pending == 0
            ),
        )
        assert other.wait(60) == 0
        ours, theirs = status(first.socket), status(second.socket)
        # the first node's step-1 push had not started: step 2 superseded it; the second
        # node's pushes were both under way (waiting for the first node to take them)
        assert (ours.replicas_sent, ours.replicas_superseded) == (1, 1)
        assert (theirs.replicas_sent, theirs.replicas_superseded) == (2, 0)
        assert ours.replicas_held == theirs.replicas_held == 1  # step 2's, the newest
        assert ours.replica_failures == theirs.replica_failures == {}
    finally:
        if other is not None:
            reap(other)
        first.stop()
        second.stop()
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
