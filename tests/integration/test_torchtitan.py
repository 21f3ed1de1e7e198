"""checkpointd.integrations.torchtitan.CheckpointdManager driven as torchtitan's Trainer drives its
checkpointer, over real FSDP2 models on 2 gloo ranks (CPU).

Not run here: torchtitan's own ``Trainer`` (it needs its datasets, tokenizer assets,
tensorboard and wandb, and a CUDA device by default); the manager is built from its
``Config`` with torchtitan's own optimizer and LR scheduler containers and ModelWrapper.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

if not os.environ.get("CI"):  # under CI a missing framework fails the collection
    pytest.importorskip("torchtitan")

import checkpointd
from tests.support.launch import run_ranks

pytestmark = [pytest.mark.timeout(240)]

JOB = "tests.support.torchtitan_job"
STEPS = 8


def _run(action: str, root: Path | str, out: Path, world: int = 2) -> dict[str, Any]:
    reports = run_ranks(JOB, [action, str(root), str(out), str(STEPS)], out, world, timeout=150)
    if action.startswith("die:"):
        return {}
    for rank, report in enumerate(reports):
        assert report is not None, (out / f"stderr{rank}.txt").read_text()[-3000:]
        assert report["ok"], report.get("error")
    return torch.load(out / "state.pt", weights_only=True)  # type: ignore[no-any-return]


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def test_killed_fsdp2_job_resumes_bit_exact_and_reshards_to_one_rank(tmp_path: Path) -> None:
    straight = _run("run", tmp_path / "straight", tmp_path / "out-straight")
    assert [c.step for c in checkpointd.list_checkpoints(str(tmp_path / "straight"))] == [6, 8]
    # Killed after step 7 (step 6 committed), resumed by fresh processes.
    _run("die:7", tmp_path / "killed", tmp_path / "out-killed")
    assert checkpointd.list_checkpoints(str(tmp_path / "killed"))[-1].step == 6
    resumed = _run("run", tmp_path / "killed", tmp_path / "out-resumed")
    _assert_same(resumed, straight)
    # One rank loads what two saved: parameters and optimizer state resharded exactly
    # (the per-rank dataloader and RNG are skipped with a warning).
    alone = _run("load", tmp_path / "straight", tmp_path / "out-alone", world=1)
    _assert_same(alone, straight)


def test_a_bad_writer_option_is_refused_when_the_config_is_made(tmp_path: Path) -> None:
    from checkpointd.errors import InvalidArgumentError
    from checkpointd.integrations.torchtitan import CheckpointdManager

    with pytest.raises(InvalidArgumentError, match="max_pending must be a positive int, not 0"):
        CheckpointdManager.Config(enable=True, folder=str(tmp_path), max_pending=0)
    config = CheckpointdManager.Config(enable=True, folder=str(tmp_path), keep_latest_k=2)
    assert config.writer_options().policy == checkpointd.RetentionPolicy(keep_last=2)
