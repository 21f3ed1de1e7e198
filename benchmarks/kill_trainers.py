"""kill -9 of trainers at random moments after ``save()`` returned, through the service.

A fork server (``python -m benchmarks.kill_trainers SOCKET``, torch imported once,
no torch op run) forks one trainer per trial, so a trial costs a fork instead of a
Python start and a torch import (seconds here). Each trainer saves steps 0, 1, 2...
of a fresh tensor per step back to back and prints ``returned STEP`` after each
``save()``; the driver kills it -9 at a random moment: a random delay (0 to
``KILL_WINDOW`` s, so the kill lands while the service plans, writes, fsyncs or
commits, or while the trainer copies its next save) after a random save returned.
Every save that printed ``returned`` must then commit, bit-exact.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import IO, Any

KILL_WINDOW = 0.3
"""Seconds after a save returned within which the kill lands (uniform)."""

STEPS = 10_000
"""Saves a trainer would make (it is killed long before: after one of its first four)."""


def expected(step: int, numel: int) -> Any:
    """The tensor a trainer saves at ``step``."""
    import torch

    return torch.randn(numel, generator=torch.Generator().manual_seed(step))


def _trainer(socket: str, root: str, numel: int) -> None:
    """A forked trainer: saves until killed (or STEPS saves), one line per returned save."""
    import checkpointd

    with checkpointd.CheckpointWriter(root, service=socket) as writer:
        for step in range(STEPS):
            writer.save(step, {"model": {"w": expected(step, numel)}})
            os.write(1, f"returned {step}\n".encode())


def serve(socket: str) -> None:
    """The fork server: per stdin line ``ROOT NUMEL``, fork a trainer, print ``started
    PID``, and ``reaped PID`` once it is gone (after every line it printed)."""
    import torch  # noqa: F401 - imported once here, before any fork

    import checkpointd  # noqa: F401

    for line in sys.stdin:
        root, numel = line.split()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _trainer(socket, root, int(numel))
            except BaseException:  # os._exit skips the interpreter's own report
                traceback.print_exc()
                sys.stderr.flush()
                code = 1
            finally:
                os._exit(code)
        os.write(1, f"started {pid}\n".encode())
        os.waitpid(pid, 0)
        os.write(1, f"reaped {pid}\n".encode())


def _until(out: IO[str], word: str) -> tuple[int, list[int]]:
    """Read ``out`` up to a ``word PID`` line: (PID, the steps returned before it)."""
    returned = []
    while True:
        line = out.readline()
        if not line:
            raise RuntimeError("the fork server ended")
        kind, value = line.split()
        if kind == word:
            return int(value), returned
        returned.append(int(value))


def kill_trials(
    socket: str, folder: Path, trials: int, numel: int, env: dict[str, str], *, seed: int = 0
) -> dict[str, Any]:
    """``trials`` trainers killed -9 as the module docstring says; each trial's checkpoints
    are checked (every returned step committed, ``load`` bit-exact) and then removed."""
    import torch

    import checkpointd
    from benchmarks.common import spawn

    chance = random.Random(seed)
    server = spawn(
        [sys.executable, "-m", "benchmarks.kill_trainers", socket],
        env=env,
        cwd=Path(__file__).resolve().parents[1],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    assert server.stdin is not None
    assert server.stdout is not None
    killed = returned = committed = 0
    started = time.perf_counter()
    try:
        for trial in range(trials):
            root = folder / f"kill{trial}"
            after, delay = chance.randrange(0, 4), chance.uniform(0, KILL_WINDOW)
            server.stdin.write(f"{root} {numel}\n")
            server.stdin.flush()
            pid, _ = _until(server.stdout, "started")
            steps: list[int] = []
            while not steps or steps[-1] < after:
                line = server.stdout.readline()
                kind, value = line.split()
                if kind == "reaped":  # ended before the kill: every save returned
                    raise RuntimeError(f"trainer {value} ended before it was killed")
                steps.append(int(value))
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)
            killed += 1
            _, more = _until(server.stdout, "reaped")
            steps += more
            returned += len(steps)
            committed += _committed(checkpointd, torch, str(root), steps, numel)
            shutil.rmtree(root, ignore_errors=True)
    finally:
        server.stdin.close()
        server.wait(60)
        server.stdout.close()
    return {
        "trainers": trials,
        "killed": killed,
        "returned": returned,
        "committed_bit_exact": committed,
        "seconds": time.perf_counter() - started,
    }


def _committed(checkpointd: Any, torch: Any, root: str, steps: list[int], numel: int) -> int:
    """How many of ``steps`` committed bit-exact under ``root`` (waiting up to 120 s for
    the service to finish them)."""
    deadline = time.monotonic() + 120
    good = 0
    for step in steps:
        while time.monotonic() < deadline:
            listed = checkpointd.list_checkpoints(root) if os.path.isdir(root) else []
            if step in {c.step for c in listed}:
                break
            time.sleep(0.02)
        try:
            loaded = checkpointd.load(root, step)
        except checkpointd.CheckpointError:
            continue
        good += bool(torch.equal(loaded.state["model"]["w"], expected(step, numel)))
    return good


if __name__ == "__main__":
    serve(sys.argv[1])
