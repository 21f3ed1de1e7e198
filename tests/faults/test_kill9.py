"""kill -9 at random moments of a process that saves in a loop.

The child resumes from the newest committed step, saves step after step
(keep_last=3) and prints each step once its handle resolved. After every
SIGKILL the newest checkpoint loads, is at least the last step reported, and
every visible checkpoint verifies bit-exact. Finally gc clears what the kills
left and nothing committed is lost.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import checkpointd
from checkpointd.maintain.cleanup import find_leftovers, remove_leftovers
from checkpointd.storage import LocalStore
from tests.faults.helpers import check_intact, make_state
from tests.support.faults import temp_files

REPO = str(Path(__file__).resolve().parents[2])

_CHILD = textwrap.dedent(
    """
    import sys
    import checkpointd
    from tests.faults.helpers import make_state
    root = sys.argv[1]
    done = checkpointd.list_checkpoints(root)
    step = done[-1].step + 1 if done else 1
    print("ready", flush=True)
    with checkpointd.CheckpointWriter(root, keep_last=3) as writer:
        while True:
            writer.save(step, make_state(step, 4096)).result()
            print(step, flush=True)
            step += 1
    """
)


def _kill_rounds(root: str, kills: int, seed: int) -> tuple[int, int]:
    """Run ``kills`` child lifetimes, each ended by SIGKILL; return (kills, last step)."""
    rng = random.Random(seed)
    last_reported = 0
    for lifetime in range(kills):
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, root],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        first: list[str] = []
        if lifetime == 0:  # at least one save is reported, so the checks below have teeth
            first.append(child.stdout.readline())
        time.sleep(rng.uniform(0.0, 0.8))
        os.kill(child.pid, signal.SIGKILL)
        out, _ = child.communicate(timeout=30)
        assert child.returncode == -signal.SIGKILL
        reported = [int(line) for line in (*first, *out.split()) if line.strip()]
        if reported:
            last_reported = max(last_reported, reported[-1])
        steps = [i.step for i in checkpointd.list_checkpoints(root)]
        if last_reported:
            assert steps, "nothing loads after a kill, though saves were reported"
            assert steps[-1] >= last_reported
            assert checkpointd.load(root).info.step >= last_reported
        check_intact(root, {s: make_state(s, 4096) for s in steps})
    store = LocalStore(root)
    remove_leftovers(store, find_leftovers(store, older_than=0))
    assert temp_files(root) == []
    assert find_leftovers(store, older_than=0) == []
    steps = [i.step for i in checkpointd.list_checkpoints(root)]
    assert steps[-1] >= last_reported
    check_intact(root, {s: make_state(s, 4096) for s in steps})
    return kills, last_reported


def test_kill9_loop(tmp_path: Path) -> None:
    _, last = _kill_rounds(str(tmp_path / "ckpt"), kills=3, seed=1)
    assert last > 0, "no save finished in any child's lifetime: the kills prove nothing"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_kill9_loop_slow(tmp_path: Path) -> None:
    kills, last = _kill_rounds(str(tmp_path / "ckpt"), kills=120, seed=2)
    assert last > 0
    print(f"kill -9: {kills} kills, last reported step {last}")
