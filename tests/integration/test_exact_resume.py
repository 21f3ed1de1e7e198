"""The proof of exact resume: a job killed after a checkpoint and restarted in a fresh
process ends bit-identical to a job that never stopped; a restore that does not fit
changes nothing."""

from __future__ import annotations

import copy
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import checkpointd
from checkpointd.cli.demo import DemoConfig, run_demo
from tests.support.resume_job import KILL_EXIT_CODE, TiedNet

REPO = Path(__file__).resolve().parents[2]
STEPS = 30
KILL_AFTER = 15  # mid-epoch: 12 batches per epoch, so epoch 1, batch 3


@dataclass(frozen=True)
class Runs:
    straight: dict[str, Any]
    before_kill: dict[str, Any]
    after_resume: dict[str, Any]
    resumed_root: str
    kill_steps: list[int]


def _job(root: Path, out: Path, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "tests.support.resume_job", str(root), str(out)]
    return subprocess.Popen(
        [*command, "--steps", str(STEPS), *extra],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _finish(process: subprocess.Popen[bytes], expected_rc: int) -> None:
    output, _ = process.communicate(timeout=120)
    assert process.returncode == expected_rc, output.decode(errors="replace")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Run the job straight to STEPS, and killed after KILL_AFTER then resumed, each in
    fresh processes (the first two side by side). The killed run trains a
    DataParallel-wrapped model; the resumed one a plain model."""
    tmp = tmp_path_factory.mktemp("resume")
    straight = _job(tmp / "straight", tmp / "straight.pt")
    killed = _job(tmp / "resumed", tmp / "before.pt", "--kill-after", str(KILL_AFTER), "--wrap")
    _finish(straight, 0)
    _finish(killed, KILL_EXIT_CODE)
    kill_steps = [c.step for c in checkpointd.list_checkpoints(str(tmp / "resumed"))]
    _finish(_job(tmp / "resumed", tmp / "after.pt"), 0)

    def read(name: str) -> dict[str, Any]:
        result: dict[str, Any] = torch.load(tmp / name, weights_only=False)
        return result

    return Runs(
        read("straight.pt"), read("before.pt"), read("after.pt"), str(tmp / "resumed"), kill_steps
    )


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    """Bit-exact equality of nested results (tensors by value and dtype)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), where
        assert a.dtype == b.dtype, where
        assert np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict), where
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple), where
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}/{i}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.timeout(240)
def test_killed_and_resumed_job_is_bit_identical_to_an_uninterrupted_one(runs: Runs) -> None:
    # The kill came at step 18, after the step-15 save was durable; the next save was due
    # at step 20, so step 15 is the newest checkpoint and the resume must start there.
    assert max(runs.kill_steps) == KILL_AFTER
    assert runs.after_resume["resumed_from"] == KILL_AFTER
    assert len(runs.before_kill["batches"]) == KILL_AFTER + 3
    # The same batches, in the same order, including the rest of the interrupted epoch.
    batches = runs.before_kill["batches"][:KILL_AFTER] + runs.after_resume["batches"]
    assert batches == runs.straight["batches"]
    assert len(batches) == STEPS
    # Same weights (tied ones still tied), optimizer moments, schedule, scaler, progress.
    _assert_same(runs.straight["params"], runs.after_resume["params"], "params")
    params = runs.after_resume["params"]
    assert torch.equal(params["out.weight"], params["inp.weight"])
    _assert_same(runs.straight["optimizer"], runs.after_resume["optimizer"], "optimizer")
    _assert_same(runs.straight["scheduler"], runs.after_resume["scheduler"], "scheduler")
    _assert_same(runs.straight["progress"], runs.after_resume["progress"], "progress")
    assert runs.straight["scale"] == runs.after_resume["scale"]
    # Every generator (Python, NumPy global, torch, the job's NumPy Generator and the
    # loader's torch.Generator) is where the uninterrupted run left it.
    _assert_same(runs.straight["next_draws"], runs.after_resume["next_draws"], "draws")
    # The run did learn something: the comparison is between moving parameters.
    assert not torch.equal(runs.before_kill["params"]["final.weight"], params["final.weight"])


def _global_rng() -> tuple[Any, ...]:
    return (random.getstate(), np.random.get_state(legacy=False), torch.get_rng_state())


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """A bit-exact copy of every live object's state, to compare after a refused restore."""
    return {
        "model": {k: v.clone() for k, v in state["model"].state_dict().items()},
        "optimizer": copy.deepcopy(state["optimizer"].state_dict()),
        "scheduler": copy.deepcopy(state["scheduler"].state_dict()),
        "generator": state["loader_generator"].get_state(),
        "progress": state["progress"].state_dict(),
    }


@pytest.mark.timeout(240)
def test_restore_into_mismatched_objects_fails_and_changes_nothing(runs: Runs) -> None:
    torch.manual_seed(5)
    model = TiedNet()
    model.final = torch.nn.Linear(8, 2)  # a different head: the checkpoint does not fit
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()  # live optimizer state that a partial restore would overwrite
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.7)
    state: dict[str, Any] = {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "scaler": torch.amp.GradScaler("cpu"),
        "loader_generator": torch.Generator().manual_seed(99),
        "label_rng": np.random.default_rng(5),
        "rng": checkpointd.RNGState(),
        "progress": checkpointd.TrainingProgress(),
    }
    before = _snapshot(state)
    rng_before = _global_rng()
    with pytest.raises(checkpointd.RestoreMismatchError, match=r"final\.(weight|bias)"):
        checkpointd.restore(runs.resumed_root, state)
    after = _snapshot(state)
    _assert_same(before["model"], after["model"], "model")
    _assert_same(before["optimizer"], after["optimizer"], "optimizer")
    assert before["scheduler"] == after["scheduler"]
    assert torch.equal(before["generator"], after["generator"])
    _assert_same(before["progress"], after["progress"], "progress")
    after_rng = _global_rng()
    assert rng_before[0] == after_rng[0]
    _assert_same(rng_before[1], after_rng[1])
    assert torch.equal(rng_before[2], after_rng[2])


def test_rng_payload_without_a_domain_is_refused(runs: Runs) -> None:
    payload = checkpointd.load(runs.resumed_root, components=["rng"]).state["rng"]
    checkpointd.RNGState().check_state_dict(payload)  # the complete payload is accepted
    del payload["numpy"]
    random.seed(11)
    expected = random.getstate(), torch.get_rng_state()
    with pytest.raises(checkpointd.RestoreMismatchError, match="missing domains \\['numpy'\\]"):
        checkpointd.RNGState().load_state_dict(payload)
    assert random.getstate() == expected[0]
    assert torch.equal(torch.get_rng_state(), expected[1])


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run torch on one thread: the shared CI cores make thread hand-offs dominate."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(240)
@pytest.mark.usefixtures("one_thread")
def test_demo_resumes_exactly_where_it_stopped(tmp_path: Path) -> None:
    def config(root: str, steps: int) -> DemoConfig:
        # 130 + 130 stops mid-epoch (100 steps each) and between saves (every 50).
        return DemoConfig(root=root, steps=steps, width=16, batch_size=16, keep_last=2)

    lines: list[str] = []
    interrupted = str(tmp_path / "interrupted")
    run_demo(config(interrupted, 130), out=lines.append)
    run_demo(config(interrupted, 130), out=lines.append)
    assert any(line.startswith("resumed from step 130") for line in lines), lines
    straight = str(tmp_path / "straight")
    run_demo(config(straight, 260), out=lambda _: None)

    a = checkpointd.load(interrupted)
    b = checkpointd.load(straight)
    assert a.info.step == b.info.step == 260
    for name in ("model", "optimizer", "scheduler", "progress", "rng"):
        _assert_same(a.state[name], b.state[name], name)


def test_demo_output_counts_epochs_from_1_and_only_reports_trained_epochs(
    tmp_path: Path,
) -> None:
    def config(steps: int) -> DemoConfig:
        return DemoConfig(root=str(tmp_path / "demo"), steps=steps, width=8, batch_size=4)

    first: list[str] = []
    run_demo(config(100), out=first.append)  # stops after the last batch of epoch 1
    second: list[str] = []
    run_demo(config(150), out=second.append)
    assert "(in epoch 1: 100 of 100 batches done)" in second[0], second
    done = [line.partition(",")[0] for line in second if " done, loss " in line]
    assert done == ["epoch 2 done"], second  # epoch 1 was trained by the first run
    third: list[str] = []
    run_demo(config(60), out=third.append)  # from step 250 (mid epoch 3) to 310
    assert "(in epoch 3: 50 of 100 batches done)" in third[0], third
    assert [line.partition(",")[0] for line in third if " done, loss " in line] == [
        "epoch 3 done"
    ], third
