"""checkpointd.integrations.accelerate with the real ``accelerate`` package on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")

import checkpointd
from checkpointd.errors import RestoreMismatchError
from tests.support import accelerate_job, zygote
from tests.support.launch import free_port

REPO = Path(__file__).resolve().parents[2]


def _fresh(root: Path, out: Path, **kwargs: object) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    cmd = [sys.executable, "-m", "tests.support.accelerate_job", str(root), str(out)]
    done = subprocess.run(
        [*cmd, "--kwargs", json.dumps(kwargs)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    loaded: dict[str, object] = torch.load(out, weights_only=True)
    return loaded


def test_mid_epoch_resume_in_fresh_process_is_exact(tmp_path: Path) -> None:
    straight, straight_seen = accelerate_job.run(str(tmp_path / "straight"))
    _, first_seen = accelerate_job.run(str(tmp_path / "run"), save_at=5)
    resumed = _fresh(tmp_path / "run", tmp_path / "out.pt", seed=99, resume=True)
    seen = first_seen + resumed["seen"]  # type: ignore[operator]
    assert len(seen) == len(straight_seen) == 16
    assert all(torch.equal(a, b) for a, b in zip(seen, straight_seen, strict=True))
    params = resumed["params"]
    assert isinstance(params, dict)
    assert set(params) == set(straight)
    assert all(torch.equal(params[k], straight[k]) for k in straight)


def test_mismatch_is_refused_before_anything_changes(tmp_path: Path) -> None:
    accelerate_job.run(str(tmp_path), save_at=3)
    with pytest.raises(RestoreMismatchError, match="model_0"):
        accelerate_job.run(str(tmp_path), resume=True, hidden=32)


def _ranks(root: Path, out: Path, world: int, **kwargs: object) -> list[dict[str, Any]]:
    """One ``world``-process accelerate job (gloo on CPU); each process's results."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    port = free_port()
    cmd = [sys.executable, "-m", "tests.support.accelerate_job", str(root), str(out)]
    cmd += ["--kwargs", json.dumps(kwargs), "--rank"]
    procs = [
        zygote.popen(
            [*cmd, str(rank), str(world), str(port)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    try:
        outputs = [proc.communicate(timeout=100)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(world)]


@pytest.mark.timeout(150)
def test_two_processes_save_and_restore_exactly_with_each_process_rng(tmp_path: Path) -> None:
    """Two processes (gloo on CPU): every process saves, one collective checkpoint; a
    fresh 2-process job restores it, each process its own RNG, and ends bit-exact."""
    straight = _ranks(tmp_path / "straight", tmp_path / "s", 2)
    first = _ranks(tmp_path / "run", tmp_path / "a", 2, save_at=3)  # mid-epoch (4 a process)
    resumed = _ranks(tmp_path / "run", tmp_path / "b", 2, seed=99, resume=True)
    for rank in range(2):
        seen = first[rank]["seen"] + resumed[rank]["seen"]
        assert len(seen) == len(straight[rank]["seen"]) == 8
        assert all(torch.equal(a, b) for a, b in zip(seen, straight[rank]["seen"], strict=True))
        want, got = straight[rank]["params"], resumed[rank]["params"]
        assert set(got) == set(want)
        assert all(torch.equal(got[k], want[k]) for k in want), f"rank {rank} differs"
    # Each process's generator came back as its own (they differ, so swapping would show).
    draws = [r["params"]["rng_draw"] for r in straight]
    assert not torch.equal(draws[0], draws[1])
    assert [c.step for c in checkpointd.list_checkpoints(str(tmp_path / "run"))] == [3]


@pytest.mark.timeout(300)
def test_two_processes_resume_exactly_from_saves_on_an_epochs_last_batch(tmp_path: Path) -> None:
    """2 processes, 3 epochs of 4 batches each: saved on epoch 0's last batch (the loader
    iterated plainly), resumed and saved mid-epoch 1, resumed through rest_of_epoch and
    saved on epoch 1's last batch, resumed to the end: bit-exact against a straight run.
    Each resume goes through load_state(accelerator, writer) with keep_last=2, and keeps 2."""
    straight = _ranks(tmp_path / "straight", tmp_path / "s", 2, epochs=3)
    run, legs = tmp_path / "run", []
    legs.append(_ranks(run, tmp_path / "a", 2, epochs=3, save_every=2, save_at=4))
    assert [c.step for c in checkpointd.list_checkpoints(str(run))] == [2, 4]
    legs.append(_ranks(run, tmp_path / "b", 2, epochs=3, resume=True, save_at=6, seed=99))
    legs.append(_ranks(run, tmp_path / "c", 2, epochs=3, resume=True, save_at=8, seed=98))
    assert [c.step for c in checkpointd.list_checkpoints(str(run))] == [6, 8]
    legs.append(_ranks(run, tmp_path / "d", 2, epochs=3, resume=True, seed=97))
    for rank in range(2):
        seen = [batch for leg in legs for batch in leg[rank]["seen"]]
        assert len(seen) == len(straight[rank]["seen"]) == 12
        for i, (a, b) in enumerate(zip(seen, straight[rank]["seen"], strict=True)):
            assert torch.equal(a, b), f"rank {rank}: batch {i} differs"
        want, got = straight[rank]["params"], legs[-1][rank]["params"]
        assert set(got) == set(want)
        assert all(torch.equal(got[k], want[k]) for k in want), f"rank {rank} differs"
