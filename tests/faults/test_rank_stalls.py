"""One outcome per save: a rank stopped with SIGSTOP (a VM pause, a swap storm) for
longer than the heartbeat limit, then resumed with SIGCONT, and a save refused on one
rank. The launcher hosts the TCP store, as torchrun's agent does, so the store
outlives every rank (tests/support/stall_job.py plays the ranks).
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import checkpointd
from tests.support.launch import free_port, start_ranks

WORLD = 2


@contextlib.contextmanager
def _ranks(scenario: str, root: Path, out: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Both ranks of ``scenario`` on a store this process hosts; killed at exit."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=True, wait_for_workers=False)
    args = [scenario, str(root), str(out)]
    procs, logs = start_ranks("tests.support.stall_job", args, out, WORLD, port)
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            proc.wait()
        for log in logs:
            log.close()
        del store


def _report(out: Path, rank: int, label: str, *, within: float = 60.0) -> dict[str, Any]:
    """Rank ``rank``'s report of its ``label`` save, waiting up to ``within`` seconds."""
    path = out / f"rank{rank}-{label}.json"
    deadline = time.monotonic() + within
    while not path.exists():
        if time.monotonic() > deadline:
            logs = {r: (out / f"stderr{r}.txt").read_text()[-2000:] for r in range(WORLD)}
            pytest.fail(f"rank {rank} wrote no {label!r} report in {within}s: {logs}")
        time.sleep(0.05)
    time.sleep(0.05)  # the file is written in one call; let it be closed
    return dict(json.loads(path.read_text()))


def _states(pid: int) -> list[str]:
    """The state letter of every thread of process ``pid`` ("T": stopped)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that just ended
            states.append((task / "stat").read_text().rsplit(") ", 1)[1][0])
    return states


def _stopped(
    proc: subprocess.Popen[bytes], out: Path, rank: int, *, within: float = 60.0
) -> dict[str, Any]:
    """Wait until rank ``rank`` has stopped itself, every thread of it (state T); what it
    saw at its stopping point (stall_job's ``rank{R}-stopping.json``, written before the
    stop): the thread that stops is the one that runs the save, so nothing of the save
    happens between that and the test's SIGCONT."""
    deadline = time.monotonic() + within
    while not all(state == "T" for state in _states(proc.pid)):
        assert proc.poll() is None, "the rank exited instead of stopping"
        assert time.monotonic() < deadline, "the rank never reached its stopping point"
        time.sleep(0.02)
    return dict(json.loads((out / f"rank{rank}-stopping.json").read_text()))


def _exited(procs: list[subprocess.Popen[bytes]], *, within: float = 60.0) -> None:
    for proc in procs:
        assert proc.wait(timeout=within) == 0


def _steps(root: Path) -> list[int]:
    return [c.step for c in checkpointd.list_checkpoints(str(root))]


def test_a_stalled_publisher_resumes_to_the_outcome_the_others_decided(tmp_path: Path) -> None:
    root, out = tmp_path / "root", tmp_path / "out"
    with _ranks("publisher_stalled_before_deciding", root, out) as procs:
        # every rank's files are durable, rank 0 holds all the posts; nothing decided
        assert _stopped(procs[0], out, 0) == {"point": "gathered files", "outcome": None}
        gave_up = _report(out, 1, "middle")
        procs[0].send_signal(signal.SIGCONT)
        resumed = _report(out, 0, "middle")
        _exited(procs)
    assert gave_up["error"] == "RankFailedError"
    assert "rank(s) [0] stopped responding" in gave_up["message"]
    # the publisher follows the decision: it publishes nothing, and retention keeps step 1
    assert resumed["error"] == "RankFailedError", resumed
    assert "failed on rank 1" in resumed["message"]
    assert resumed["committed"] == [1]
    assert resumed["loads"] is True
    assert all(_report(out, r, "last")["ok"] for r in range(WORLD))
    assert _steps(root) == [3]
    checkpointd.load(str(root))  # verifies every byte


def test_a_publisher_stalled_after_the_decision_is_published_by_the_other_rank(
    tmp_path: Path,
) -> None:
    root, out = tmp_path / "root", tmp_path / "out"
    with _ranks("publisher_stalled_after_deciding", root, out) as procs:
        # committed is decided, the manifest not yet published
        assert _stopped(procs[0], out, 0)["point"] == "publishing"
        stood_in = _report(out, 1, "middle")
        assert _steps(root) == [1, 2]  # rank 1 published the posted manifest
        procs[0].send_signal(signal.SIGCONT)
        resumed = _report(out, 0, "middle")
        _exited(procs)
    assert stood_in["ok"], stood_in
    assert resumed["ok"], resumed  # the same manifest is there: its own publish agrees
    assert resumed["committed"] == [2]  # then its retention ran (keep_last=1)
    assert resumed["loads"] is True
    assert _steps(root) == [3]
    checkpointd.load(str(root))


def test_a_stalled_rank_that_resumes_fails_typed_and_the_job_goes_on(tmp_path: Path) -> None:
    root, out = tmp_path / "root", tmp_path / "out"
    with _ranks("follower_stalled_before_writing", root, out) as procs:
        assert _stopped(procs[1], out, 1) == {"point": "writing its share", "outcome": None}
        gave_up = _report(out, 0, "middle")  # its writer stays open: heartbeats go on
        procs[1].send_signal(signal.SIGCONT)
        resumed = _report(out, 1, "middle", within=30)
        _exited(procs)
    assert gave_up["error"] == "RankFailedError"
    assert "rank(s) [1] stopped responding" in gave_up["message"]
    assert resumed["error"] == "RankFailedError", resumed
    assert "failed on rank 0" in resumed["message"]
    assert resumed["seconds"] < gave_up["seconds"] + 30  # bounded, not "until rank 0 leaves"
    assert gave_up["committed"] == [1]
    assert all(_report(out, r, "last")["ok"] for r in range(WORLD))
    assert _steps(root) == [3]
    leftovers = (
        [p.name for p in (root / f"{2:012d}").iterdir()] if (root / f"{2:012d}").exists() else []
    )
    assert leftovers == []  # nothing of the abandoned step 2 stays behind


def test_a_save_refused_on_one_rank_fails_the_others_at_once_and_a_retry_saves(
    tmp_path: Path,
) -> None:
    root, out = tmp_path / "root", tmp_path / "out"
    with _ranks("refused_on_one_rank", root, out) as procs:
        refused = _report(out, 1, "middle")
        waited = _report(out, 0, "middle")
        _exited(procs)
    assert refused["error"] == "UnsupportedValueError"
    assert waited["error"] == "RankFailedError"
    assert "its save() was refused" in waited["message"]
    assert waited["seconds"] < 20  # the writer's join_seconds is 60 in this job
    retried = [_report(out, r, "last") for r in range(WORLD)]
    assert all(r["ok"] for r in retried), retried
    assert _steps(root) == [2]
