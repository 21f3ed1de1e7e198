"""checkpointd.accelerate with the real ``accelerate`` package on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from checkpointd.errors import RestoreMismatchError
from tests.support import accelerate_job

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
