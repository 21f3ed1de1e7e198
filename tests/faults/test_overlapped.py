"""Overlapped staging under hostile timing: a training thread racing the copy, fork,
SIGTERM, close and interpreter exit while a save is still staging.

The race test fills every tensor of the state with the step counter: a stored
checkpoint of step k must hold k everywhere (a tensor holding two values, or
tensors holding different values, is a torn snapshot, a state that never existed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import checkpointd
from checkpointd.state.tree import walk
from checkpointd.write import staging as staging_module

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX fork and signals")


class Counted(torch.nn.Module):
    """Parameters (optimized) and a buffer (changed in forward), all filled with one value."""

    def __init__(self, tensors: int, numel: int) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros(numel)) for _ in range(tensors)
        )
        self.register_buffer("seen", torch.zeros(numel))

    def forward(self, value: int) -> None:
        self.seen.fill_(value)  # as BatchNorm updates its running statistics in forward


class FillOptimizer(torch.optim.Optimizer):
    """A step sets every parameter and its state tensor to ``value``."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {})
        self.value = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "moment" not in state:
                    state["moment"] = torch.zeros_like(p)
                p.fill_(self.value)
                state["moment"].fill_(self.value)


def test_a_training_thread_racing_overlapped_saves_never_stores_a_torn_state(
    tmp_path: Path,
) -> None:
    model = Counted(tensors=4, numel=1 << 18)  # 1 MiB each: copies take long enough to race
    optimizer = FillOptimizer(model.parameters())
    ema = {"shadow": torch.zeros(1 << 18)}  # a user tensor changed outside any step
    state = {"model": model, "optimizer": optimizer, "ema": ema}
    saves = []
    with checkpointd.CheckpointWriter(str(tmp_path), staging="overlapped", max_pending=2) as writer:
        for value in range(1, 49):
            model(value)
            ema["shadow"].fill_(value)
            optimizer.value = value
            optimizer.step()
            if value % 8 == 0:
                saves.append(writer.save(value, state))
        for handle in saves:
            handle.result(timeout=60)
    assert len(saves) == 6
    for handle in saves:
        stored = checkpointd.load(str(tmp_path), handle.step).state
        tensors = [leaf for _, leaf in walk(stored) if isinstance(leaf, torch.Tensor)]
        assert len(tensors) == 4 + 1 + 4 + 1  # weights, buffer, moments, ema
        for tensor in tensors:
            assert tensor.min().item() == tensor.max().item() == handle.step, handle.step


def test_close_waits_for_a_save_still_staging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    real = staging_module.copy_in_background
    monkeypatch.setattr(
        staging_module, "copy_in_background", lambda copies: (gate.wait(60), real(copies))
    )
    model = Counted(tensors=2, numel=16)
    optimizer = FillOptimizer(model.parameters())
    optimizer.value = 5
    optimizer.step()
    writer = checkpointd.CheckpointWriter(str(tmp_path), staging="overlapped")
    handle = writer.save(5, {"model": model, "optimizer": optimizer})
    closer = threading.Thread(target=writer.close)
    closer.start()
    closer.join(0.3)
    waited = closer.is_alive()
    gate.set()
    closer.join(60)
    assert waited, "close() returned while the save was still staging"
    assert handle.result(timeout=1).step == 5
    assert [c.step for c in checkpointd.list_checkpoints(str(tmp_path))] == [5]


_SCRIPT_HEAD = """
import json, os, select, signal, sys, threading, time
import torch
import checkpointd
from checkpointd.write import staging

root = sys.argv[1]
model = torch.nn.Linear(64, 64)
optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
model(torch.ones(2, 64)).sum().backward()
optimizer.step()
before = model.weight.detach().clone()
"""

_FORK_SCRIPT = _SCRIPT_HEAD + textwrap.dedent(
    """
    gate = threading.Event()
    real = staging.copy_in_background
    staging.copy_in_background = lambda copies: (gate.wait(60), real(copies))
    writer = checkpointd.CheckpointWriter(root, staging="overlapped")
    handle = writer.save(1, {"model": model, "optimizer": optimizer})
    pid = os.fork()
    if pid == 0:
        problems = []
        optimizer.step()  # the step pre-hook must not wait for the parent's copier thread
        for name, call in {"writer.wait_staged": writer.wait_staged,
                           "handle.wait_staged": handle.wait_staged}.items():
            try:
                call()
                problems.append(f"{name} did not raise")
            except checkpointd.WriterClosedError:
                pass
        writer.close()
        sys.stderr.write("\\n".join(problems))
        os._exit(3 if problems else 0)
    ready, _, _ = select.select([os.pidfd_open(pid)], [], [], 20)
    if not ready:
        os.kill(pid, 9)
    _, status = os.waitpid(pid, 0)
    gate.set()
    info = handle.result(timeout=60)
    writer.close()
    stored = checkpointd.load(root).state["model"]["weight"]
    print(json.dumps({"hung": not ready, "child": os.waitstatus_to_exitcode(status),
                      "step": info.step, "same": bool(torch.equal(stored, before))}))
    """
)


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs os.pidfd_open (Linux)")
def test_fork_child_steps_without_waiting_for_the_parents_staging(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", "-c", _FORK_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome == {"hung": False, "child": 0, "step": 1, "same": True}, done.stderr


_EXIT_SCRIPT = _SCRIPT_HEAD + textwrap.dedent(
    """
    mode = sys.argv[2]
    writer = checkpointd.CheckpointWriter(root, staging="overlapped")
    if mode == "sigterm":
        writer.watch_preemption()
        os.kill(os.getpid(), signal.SIGTERM)
        assert writer.save_if_preempted(7, {"model": model, "optimizer": optimizer})
        optimizer.step()
        writer.close()
    else:  # unclosed: the exit hook finishes the staging save
        writer.save(7, {"model": model, "optimizer": optimizer})
    print(json.dumps({"weight": before.flatten()[:4].tolist()}))
    """
)


@pytest.mark.parametrize("mode", ["sigterm", "unclosed"])
def test_a_staging_save_is_durable_after_sigterm_or_exit(tmp_path: Path, mode: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path), mode],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    expected = json.loads(done.stdout.strip().splitlines()[-1])["weight"]
    stored = checkpointd.load(str(tmp_path), 7).state["model"]["weight"]
    assert stored.flatten()[:4].tolist() == pytest.approx(expected)
