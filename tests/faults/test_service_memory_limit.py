"""A real service under ``--memory-limit`` with a trainer whose state grows between saves
(40 MiB, then 120 MiB, under 150 MiB): the segment asked for ahead of the second save
is given back while the larger one waits for memory, so the save returns and commits;
a trainer killed while its save waits for memory leaves nothing behind."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import checkpointd
from checkpointd.daemon.client.client import status
from tests.support import zygote
from tests.support.service import REPO, child_env, reap, running_service, wait_for

MIB = 1024 * 1024


def _grow(socket: str, root: str, first: int) -> subprocess.Popen[str]:
    return zygote.popen(
        [sys.executable, "-m", "tests.support.growing_job", socket, root, str(first), "null"],
        env=child_env(),
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _run_to_end(proc: subprocess.Popen[str], timeout: float = 60) -> str:
    """``proc``'s stdout once it exited 0; AssertionError (with its stderr) if it did not
    within ``timeout`` seconds (killed then)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        err = reap(proc)
        raise AssertionError(f"the trainer hung (killed after {timeout}s): {err[-2000:]}") from None
    assert proc.returncode == 0, err[-3000:]
    return out


def _steps(root: str) -> list[int]:
    return [c.step for c in checkpointd.list_checkpoints(root)]


def test_a_growing_state_under_the_memory_limit_returns_and_commits(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    with running_service("--memory-limit", "150M") as service:
        out = _run_to_end(_grow(service.socket, root, 1))
        assert out.split("\n")[-2] == "committed"
        assert _steps(root) == [1, 2]
        wait_for(lambda: status(service.socket).clients == 0)
        reply = status(service.socket)
        assert reply.bytes_staged == 0
        assert reply.bytes_staged + reply.bytes_kept <= 150 * MIB
    loaded = checkpointd.load(root, 2)
    assert loaded.state["model"]["weights"].numel() == 120 * MIB // 4
    assert float(loaded.state["model"]["weights"][-1]) == 2.0


def test_a_trainer_killed_while_its_save_waits_for_memory_releases_it(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    gate = tmp_path / "gate"
    with running_service("--memory-limit", "150M", gate=str(gate)) as service:
        proc = _grow(service.socket, root, 1)
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "returned 1"  # held in flight by the gate
            assert proc.stdout.readline().strip() == "saving 2"
            # step 2's 120 MiB cannot fit beside step 1's 40 MiB until step 1 resolves:
            # its save waits for memory, once the segment asked for ahead is given back
            wait_for(lambda: status(service.socket).bytes_staged < 80 * MIB, 60)
            assert proc.poll() is None
            proc.send_signal(signal.SIGKILL)
        finally:
            reap(proc)
        assert proc.returncode == -signal.SIGKILL
        wait_for(lambda: status(service.socket).clients == 0, 20)
        assert status(service.socket).saves_in_flight == 1  # step 1 still commits
        gate.touch()
        wait_for(lambda: status(service.socket).saves_in_flight == 0, 60)
        reply = status(service.socket)
        assert (reply.committed, reply.bytes_staged) == (1, 0)
        # the next trainer's saves are not held back by anything the dead one left
        out = _run_to_end(_grow(service.socket, root, 3))
        assert out.split("\n")[-2] == "committed"
        wait_for(lambda: status(service.socket).clients == 0)
        reply = status(service.socket)
        assert (reply.committed, reply.bytes_staged) == (3, 0)
    assert _steps(root) == [1, 3, 4]
