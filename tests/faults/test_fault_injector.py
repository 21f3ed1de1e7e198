"""The fault injector itself: it must not leave temporary folders behind."""

from __future__ import annotations

import gc
import os
import tempfile
import time
from pathlib import Path

import pytest

import checkpointd
from tests.faults.helpers import make_state
from tests.support.faults import FaultyOS, SimulatedCrash


@pytest.mark.parametrize("power", [False, True], ids=["crash", "power-loss"])
def test_faulty_os_leaves_no_temporary_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, power: bool
) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where mkdtemp would put one
    root = str(tmp_path / "ckpt")
    with checkpointd.CheckpointWriter(root) as writer:
        writer.save(1, make_state(1)).result(timeout=60)

    # A save with retention (an rmtree, moved aside into the shadow), then a crash at the end.
    faulty = FaultyOS(track_power=power)
    with monkeypatch.context() as patch:
        faulty.install(patch)
        with checkpointd.CheckpointWriter(root, keep_last=1) as writer:
            writer.save(2, make_state(2)).result(timeout=60)
            writer.save(3, make_state(3)).result(timeout=60)  # deletes its own step 2
        faulty.crash_after = faulty.count + 1
        with (
            pytest.raises((checkpointd.CheckpointError, SimulatedCrash)),
            checkpointd.CheckpointWriter(root, keep_last=1) as writer,
        ):
            writer.save(4, make_state(4)).result(timeout=60)
        if power:
            faulty.power_off()
    assert any(op == "rmtree" for op, _ in faulty.log)
    del faulty  # no explicit cleanup(): a test that forgets it must not leak either
    # An anyio worker thread reports a failed call before it drops its locals, so the
    # exception (whose traceback reaches the wrapper) can outlive the writer by a moment.
    deadline = time.monotonic() + 10
    while os.listdir(scratch) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert os.listdir(scratch) == []
