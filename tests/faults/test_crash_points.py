"""A crash after every single I/O step of a save, with and without a power loss.

For a save of five files (plus the manifest), the process "dies" after
the N-th mutating system call, for every N; with ``power`` the crash is also a
power loss that drops every byte and folder change not fsynced. Afterwards no
torn checkpoint is visible, the previous checkpoint (or the new one) loads
bit-exact, and a save that reported success survives. ``direct`` saves a tensor
large enough (>= DIRECT_MIN_BYTES) to go through the O_DIRECT path (directio.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import checkpointd
import checkpointd.retention
from checkpointd.storage.directio import DIRECT_MIN_BYTES
from tests.faults.helpers import check_intact, make_state
from tests.support.faults import FaultyOS, SimulatedCrash

DIRECT_SIZE = DIRECT_MIN_BYTES // 16
"""make_state's size whose (size, 4) float32 tensor is DIRECT_MIN_BYTES: written with O_DIRECT."""


def _save_step2(
    root: str, faulty: FaultyOS, monkeypatch: pytest.MonkeyPatch, size: int = 256
) -> bool:
    """Save step 2 through ``faulty``; True if its handle reported success."""
    with monkeypatch.context() as patch:
        faulty.install(patch)
        ok = False
        try:
            with checkpointd.CheckpointWriter(root, keep_last=1) as writer:
                writer.save(2, make_state(2, size)).result()
                ok = True
        except (checkpointd.CheckpointError, SimulatedCrash):
            pass
        if faulty.track_power:
            faulty.power_off()
    faulty.cleanup()
    return ok


@pytest.mark.parametrize(
    ("power", "size"),
    [(False, 256), (True, 256), (True, DIRECT_SIZE)],
    ids=["crash", "power-loss", "direct-power-loss"],
)
def test_crash_after_every_io_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, power: bool, size: int
) -> None:
    expected = {1: make_state(1, size), 2: make_state(2, size)}
    # Step 1 comes from another writer instance: without a grace window, step 2's
    # retention deletes it, so the crash points cover retention too.
    monkeypatch.setattr(checkpointd.tunables, "GRACE_SECONDS", 0.0)

    template = str(tmp_path / "template")
    with checkpointd.CheckpointWriter(template) as writer:
        writer.save(1, expected[1]).result()

    def fresh(name: str) -> str:
        return shutil.copytree(template, str(tmp_path / name))

    # A clean run, to count the calls a full save (with retention) makes.
    probe = FaultyOS(track_power=power)
    assert _save_step2(fresh("probe"), probe, monkeypatch, size)
    total = probe.count
    ops = {op for op, _ in probe.log}
    assert {"create", "write", "fsync", "fsync_dir", "replace", "link", "unlink", "rmtree"} <= ops
    assert ("write_direct" in ops) == (size == DIRECT_SIZE), "direct I/O taken (only) if large"

    outcomes = {"old": 0, "new": 0}
    for n in range(1, total + 1):
        root = fresh(f"n{n}")
        faulty = FaultyOS(crash_after=n, track_power=power)
        reported = _save_step2(root, faulty, monkeypatch, size)
        step_at_crash = faulty.log[n - 1] if n <= len(faulty.log) else ("none", "")
        visible = check_intact(root, expected)
        assert visible, f"nothing loads after a crash after call {n} {step_at_crash}"
        if reported:
            assert 2 in visible, f"step 2 was reported durable but lost (crash after {n})"
        outcomes["new" if 2 in visible else "old"] += 1
    # Both outcomes happen: early crashes keep the old checkpoint, late ones the new.
    assert outcomes["old"] > 0
    assert outcomes["new"] > 0
    print(f"crash points: {total} ({'power loss' if power else 'crash'}); outcomes {outcomes}")
