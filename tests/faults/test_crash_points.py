"""A crash after every single I/O step of a save, with and without a power loss.

For a save of five files (plus the manifest), the process "dies" after
the N-th mutating system call, for every N; with ``power`` the crash is also a
power loss that drops every byte and folder change not fsynced. Afterwards no
torn checkpoint is visible, the previous checkpoint (or the new one) loads
bit-exact, and a save that reported success survives. ``direct`` saves a tensor
large enough (>= tunables.DIRECT_MIN_BYTES) to go through the O_DIRECT path (directio.py).
``incremental`` saves both steps with ``incremental=True`` and a frozen tensor
they share: the crash points then cover the pin, the blob writes and the
reference-aware deletion of step 1's own blobs by retention.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import checkpointd
import checkpointd.maintain.retention
from checkpointd import tunables
from tests.faults.helpers import check_intact, make_state
from tests.support.faults import FaultyOS, SimulatedCrash

DIRECT_SIZE = tunables.DIRECT_MIN_BYTES // 16
"""make_state's size whose (size, 4) float32 tensor is tunables.DIRECT_MIN_BYTES: written with O_DIRECT."""


def _state(step: int, size: int, incremental: bool) -> dict[str, Any]:
    """make_state, plus (incremental) a frozen tensor every step shares."""
    state = make_state(step, size)
    if incremental:
        state["frozen"] = {"base": torch.arange(size * 4, dtype=torch.float32)}
    return state


def _save_step2(
    root: str,
    faulty: FaultyOS,
    monkeypatch: pytest.MonkeyPatch,
    size: int = 256,
    incremental: bool = False,
) -> bool:
    """Save step 2 through ``faulty``; True if its handle reported success."""
    with monkeypatch.context() as patch:
        faulty.install(patch)
        ok = False
        try:
            with checkpointd.CheckpointWriter(root, keep_last=1, incremental=incremental) as writer:
                writer.save(2, _state(2, size, incremental)).result()
                ok = True
        except (checkpointd.CheckpointError, SimulatedCrash):
            pass
        if faulty.track_power:
            faulty.power_off()
    faulty.cleanup()
    return ok


@pytest.mark.parametrize(
    ("power", "size", "incremental"),
    [
        (False, 256, False),
        (True, 256, False),
        (True, DIRECT_SIZE, False),
        (False, 256, True),
        (True, 256, True),
    ],
    ids=["crash", "power-loss", "direct-power-loss", "incremental-crash", "incremental-power-loss"],
)
def test_crash_after_every_io_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, power: bool, size: int, incremental: bool
) -> None:
    # Incremental: every tensor of 1 KiB or more is a shared blob.
    monkeypatch.setattr(checkpointd.tunables, "INCREMENTAL_MIN_BYTES", 1024)
    expected = {1: _state(1, size, incremental), 2: _state(2, size, incremental)}
    # Step 1 comes from another writer instance: without a grace window, step 2's
    # retention deletes it, so the crash points cover retention too.
    monkeypatch.setattr(checkpointd.tunables, "GRACE_SECONDS", 0.0)

    template = str(tmp_path / "template")
    with checkpointd.CheckpointWriter(template, incremental=incremental) as writer:
        writer.save(1, expected[1]).result()

    def fresh(name: str) -> str:
        return shutil.copytree(template, str(tmp_path / name))

    # A clean run, to count the calls a full save (with retention) makes.
    probe = FaultyOS(track_power=power)
    assert _save_step2(fresh("probe"), probe, monkeypatch, size, incremental)
    total = probe.count
    ops = {op for op, _ in probe.log}
    assert {"create", "write", "fsync", "fsync_dir", "replace", "link", "unlink", "rmtree"} <= ops
    assert ("write_direct" in ops) == (size == DIRECT_SIZE), "direct I/O taken (only) if large"

    outcomes = {"old": 0, "new": 0}
    for n in range(1, total + 1):
        root = fresh(f"n{n}")
        faulty = FaultyOS(crash_after=n, track_power=power)
        reported = _save_step2(root, faulty, monkeypatch, size, incremental)
        step_at_crash = faulty.log[n - 1] if n <= len(faulty.log) else ("none", "")
        visible = check_intact(root, expected)
        assert visible, f"nothing loads after a crash after call {n} {step_at_crash}"
        if reported:
            assert 2 in visible, f"step 2 was reported durable but lost (crash after {n})"
        outcomes["new" if 2 in visible else "old"] += 1
        if incremental and visible == [2]:
            # Step 1 deleted: its own blobs go, the frozen one step 2 shares stays.
            blobs = set(os.listdir(os.path.join(root, "blobs")))
            assert len(blobs) >= 4, f"blobs lost after a crash after call {n}"
    # Both outcomes happen: early crashes keep the old checkpoint, late ones the new.
    assert outcomes["old"] > 0
    assert outcomes["new"] > 0
    print(f"crash points: {total} ({'power loss' if power else 'crash'}); outcomes {outcomes}")
