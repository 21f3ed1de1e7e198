"""fork() children of a process with an open writer: they exit at once and write nothing.

The children are real forks: DataLoader workers, a multiprocessing Pool, and a
plain os.fork() child ending in sys.exit (run in a subprocess, so the child never
unwinds through pytest). Each time the parent has a save held in flight.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import checkpointd
from checkpointd.read.catalog import read_manifest
from checkpointd.storage import open_store
from tests.support.gates import hold_local_writes

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()"),
    # Python 3.12+ warns about fork() in a multi-threaded process: forking is the point here.
    pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning"),
]


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _epoch(dataset: TensorDataset) -> float:
    loader = DataLoader(dataset, batch_size=8, num_workers=2, multiprocessing_context="fork")
    started = time.perf_counter()
    batches = sum(1 for _ in loader)
    assert batches == 8
    return time.perf_counter() - started


def test_dataloader_fork_workers_exit_promptly_with_a_save_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dataset = TensorDataset(torch.arange(64.0))
    baseline = _epoch(dataset)
    gate = hold_local_writes(monkeypatch)
    with checkpointd.CheckpointWriter(str(tmp_path)) as writer:
        handle = writer.save(1, {"m": {"w": torch.ones(100)}})
        with_writer = _epoch(dataset)
        assert not handle.done()  # the save was in flight through the whole epoch
        gate.set()
        assert handle.result(timeout=60).step == 1
    # Before the fix every worker hung in the inherited exit hook until torch killed it
    # (about 5 s per worker): 10 s an epoch instead of about 0.1 s.
    assert with_writer < baseline + 2.5, (baseline, with_writer)
    assert [c.step for c in checkpointd.list_checkpoints(str(tmp_path))] == [1]


def _square(x: int) -> int:
    return x * x


def test_multiprocessing_fork_pool_close_and_join_return(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = hold_local_writes(monkeypatch)
    writer = checkpointd.CheckpointWriter(str(tmp_path))
    handle = writer.save(1, {"m": {"w": torch.ones(100)}})
    pool = multiprocessing.get_context("fork").Pool(2)
    try:
        assert pool.map(_square, range(6)) == [0, 1, 4, 9, 16, 25]
        pool.close()
        joiner = threading.Thread(target=pool.join)
        joiner.start()
        joiner.join(30)
        assert not joiner.is_alive(), "Pool.join() did not return: a worker hung at exit"
    finally:
        pool.terminate()
    gate.set()
    assert handle.result(timeout=60).step == 1
    writer.close()


_FORK_SCRIPT = textwrap.dedent(
    """
    import json, os, select, sys, threading, time
    import torch, checkpointd
    from checkpointd.storage import LocalStore

    root = sys.argv[1]
    gate = threading.Event()
    real_make_dir = LocalStore.make_dir
    LocalStore.make_dir = lambda self, path: (gate.wait(60), real_make_dir(self, path))[1]

    writer = checkpointd.CheckpointWriter(root)
    handle = writer.save(1, {"m": {"w": torch.ones(1000)}})
    pid = os.fork()
    if pid == 0:
        problems = []
        calls = {
            "save": lambda: writer.save(2, {"m": {"w": torch.zeros(1000)}}),
            "wait": writer.wait,
            "handle.result": lambda: handle.result(timeout=5),
        }
        for name, call in calls.items():
            try:
                call()
                problems.append(f"{name} did not raise")
            except checkpointd.WriterClosedError as exc:
                if "fork" not in str(exc):
                    problems.append(f"{name}: {exc}")
            except BaseException as exc:
                problems.append(f"{name}: {type(exc).__name__}: {exc}")
        writer.close()  # a no-op in the child
        sys.stderr.write("\\n".join(problems))
        sys.exit(3 if problems else 0)

    started = time.monotonic()
    ready, _, _ = select.select([os.pidfd_open(pid)], [], [], 20)
    exit_seconds = time.monotonic() - started
    if not ready:
        os.kill(pid, 9)
    _, status = os.waitpid(pid, 0)
    gate.set()
    info = handle.result(timeout=60)
    writer.close()
    print(json.dumps({"hung": not ready, "child_status": os.waitstatus_to_exitcode(status),
                      "exit_seconds": exit_seconds, "step": info.step}))
    """
)


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs os.pidfd_open (Linux)")
def test_os_fork_child_exits_promptly_and_cannot_use_the_writer(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    done = subprocess.run(
        [sys.executable, "-c", _FORK_SCRIPT, str(root)],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert not outcome["hung"], "the fork child hung at exit"
    assert outcome["child_status"] == 0, done.stderr
    assert outcome["step"] == 1  # the parent's in-flight save was unaffected
    # The child wrote nothing: only the parent's step 1 is there, and no temp files.
    assert [c.step for c in checkpointd.list_checkpoints(str(root))] == [1]
    manifest = read_manifest(open_store(str(root)), 1)
    listed = sorted(f"000000000001/{f.path}" for f in manifest.files)
    assert _files(root) == ["000000000001", *listed, "000000000001/manifest.json"]
