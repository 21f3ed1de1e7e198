"""What a writer killed mid-commit leaves behind never blocks the next writer.

A job killed while committing step N leaves files (and, from versions before
per-attempt file names, ``writer.lock``) in N's folder. Restarted on another
node or in the same container (same host, same PID), it saves step N again:
that save must commit at once, and its commit removes the dead writer's
leftovers once they are older than the gc threshold.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

import checkpointd
from checkpointd import tunables
from checkpointd.format.manifest import MANIFEST_NAME
from tests.faults.helpers import check_intact, make_state

STEP2 = f"{2:012d}"


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def _old_style_lock(host: str, pid: int) -> bytes:
    """The lease an older checkpointd wrote while committing, as a fresh (unexpired) one."""
    lease = {"host": host, "pid": pid, "token": "deadbeefdeadbeef", "acquired_at": time.time()}
    return json.dumps(lease).encode()


@pytest.mark.parametrize("holder", ["other-node", "same-container"])
def test_dead_writers_leftovers_do_not_block_a_new_writer(tmp_path: Path, holder: str) -> None:
    root = str(tmp_path / "ckpt")
    expected = {1: make_state(1), 2: make_state(2)}
    with checkpointd.CheckpointWriter(root) as writer:
        writer.save(1, expected[1]).result(timeout=60)
    folder = Path(root, STEP2)
    folder.mkdir()
    # The same container restarts with the same host name and the same PID (1 there; ours here).
    host, pid = (
        ("node-7f3c.cluster", 27539)
        if holder == "other-node"
        else (socket.gethostname(), os.getpid())
    )
    (folder / "writer.lock").write_bytes(_old_style_lock(host, pid))
    (folder / "model.safetensors").write_bytes(b"x" * 4096)  # renamed before the kill
    (folder / "opt.0badf00d.safetensors").write_bytes(b"y" * 512)
    (folder / "meta.tree.msgpack.tmp-0123456789ab").write_bytes(b"z" * 100)

    with checkpointd.CheckpointWriter(root) as writer:
        info = writer.save(2, expected[2]).result(timeout=60)

    assert info.step == 2
    assert check_intact(root, expected) == [1, 2]


def test_recommit_removes_old_leftovers_and_spares_young_ones(tmp_path: Path) -> None:
    """The winner of a re-commit sweeps what is older than the gc threshold, nothing younger."""
    root = str(tmp_path / "ckpt")
    folder = Path(root, STEP2)
    folder.mkdir(parents=True)
    stale = {
        "model.safetensors.tmp-0123456789ab": 2**20,  # a dead writer's large temp file
        "model.0badf00d.safetensors": 4096,
        "writer.lock": 64,
    }
    for name, size in stale.items():
        (folder / name).write_bytes(b"s" * size)
        _age(folder / name, tunables.GC_OLDER_THAN + 60)
    young = "opt.cafebabe.tree.msgpack"  # may belong to a live writer that is about to lose
    (folder / young).write_bytes(b"y" * 10)

    with checkpointd.CheckpointWriter(root) as writer:
        info = writer.save(2, make_state(2)).result(timeout=60)

    manifest = json.loads((folder / MANIFEST_NAME).read_bytes())
    listed = {entry["path"] for entry in manifest["files"]}
    assert sorted(os.listdir(folder)) == sorted({MANIFEST_NAME, young, *listed})
    assert info.nbytes == sum((folder / name).stat().st_size for name in listed)
    assert check_intact(root, {2: make_state(2)}) == [2]
