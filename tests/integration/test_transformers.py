"""checkpointd.integrations.transformers.CheckpointdTrainer inside real ``Trainer.train`` runs on CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

if not os.environ.get("CI"):  # under CI a missing framework fails the collection
    pytest.importorskip("transformers")

import checkpointd
from checkpointd.errors import InvalidArgumentError, RestoreMismatchError
from tests.conftest import Root
from tests.support import transformers_job, zygote

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.timeout(240)]


def _job(output_dir: Path, out: Path | None = None, **kwargs: Any) -> subprocess.Popen[str]:
    """Start the Trainer job in a fresh process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    env["HF_HUB_OFFLINE"] = "1"
    cmd = [sys.executable, "-m", "tests.support.transformers_job", str(output_dir)]
    cmd += ["--kwargs", json.dumps(kwargs)] + (["--out", str(out)] if out else [])
    return zygote.popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _kill_when_ready(proc: subprocess.Popen[str]) -> str:
    """Read the job's output until it says READY, then SIGKILL it; return what it printed."""
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("READY"):
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "".join(seen)
    return "".join(seen)


def _finish(proc: subprocess.Popen[str]) -> None:
    output, _ = proc.communicate(timeout=200)
    assert proc.returncode == 0, output


def _assert_same(resumed: dict[str, torch.Tensor], straight: dict[str, torch.Tensor]) -> None:
    assert set(resumed) == set(straight)
    for name, tensor in straight.items():
        other = resumed[name]
        assert other.dtype == tensor.dtype, name
        assert other.shape == tensor.shape, name
        assert torch.equal(other, tensor), name


def _kill_and_resume(
    tmp_path: Path, kill_after: int, committed: int, **options: Any
) -> dict[str, torch.Tensor]:
    """Run the job in a fresh process, kill it with SIGKILL after ``kill_after`` steps (the
    newest committed checkpoint then being ``committed``), resume it in another fresh
    process; return what the resumed run ended with."""
    out_dir = tmp_path / "killed"
    _kill_when_ready(_job(out_dir, kill_after=kill_after, **options))
    root = options.get("root") or str(out_dir / "checkpointd")
    infos = checkpointd.list_checkpoints(root, storage_options=options.get("storage_options"))
    assert infos[-1].step == committed
    _finish(_job(out_dir, tmp_path / "resumed.pt", resume=True, **options))
    return torch.load(tmp_path / "resumed.pt", weights_only=True)  # type: ignore[no-any-return]


def test_killed_mid_epoch_and_resumed_in_fresh_process_is_bit_exact(tmp_path: Path) -> None:
    straight = transformers_job.fit(str(tmp_path / "straight"))
    # 12 steps an epoch, saves every 4: killed in the first epoch after step 10, so the
    # resume starts from step 8 with 4 batches of the epoch to skip.
    resumed = _kill_and_resume(tmp_path, kill_after=10, committed=8)
    _assert_same(resumed, straight)
    # save_total_limit=2, applied after each commit; Trainer wrote no checkpoint-N of its own.
    assert [
        c.step for c in checkpointd.list_checkpoints(str(tmp_path / "straight" / "checkpointd"))
    ] == [20, 24]
    assert sorted(os.listdir(tmp_path / "straight")) == ["checkpointd"]
    root = tmp_path / "killed" / "checkpointd"
    # The resumed run restored step 8, so it continues the killed run's lineage: retention
    # prunes the killed run's steps as its own (save_total_limit=2).
    assert [c.step for c in checkpointd.list_checkpoints(str(root))] == [20, 24]
    names = {p.name.split(".")[-1] for p in root.rglob("*") if p.is_file()}
    assert names <= {"json", "msgpack", "safetensors"}


def test_gradient_accumulation_resume_is_bit_exact(tmp_path: Path) -> None:
    options = {"gradient_accumulation_steps": 2, "save_steps": 2}
    straight = transformers_job.fit(str(tmp_path / "straight"), **options)
    # 6 updates an epoch: killed after update 5, resumed from 4 (8 micro-batches skipped).
    resumed = _kill_and_resume(tmp_path, kill_after=5, committed=4, **options)
    _assert_same(resumed, straight)


def test_s3_killed_and_resumed_is_bit_exact(s3_root: Root, tmp_path: Path) -> None:
    options = {"root": f"{s3_root.url}/run", "storage_options": s3_root.storage_options}
    straight = transformers_job.fit(str(tmp_path / "straight"))
    resumed = _kill_and_resume(tmp_path, kill_after=6, committed=4, **options)
    _assert_same(resumed, straight)
    assert not (tmp_path / "killed" / "checkpointd").exists()


def test_resume_refuses_other_batch_size(tmp_path: Path) -> None:
    assert not transformers_job.trainer(str(tmp_path)).has_checkpoint()
    transformers_job.fit(str(tmp_path), max_steps=4)
    assert transformers_job.trainer(str(tmp_path)).has_checkpoint()
    with pytest.raises(RestoreMismatchError, match="per_device_train_batch_size"):
        transformers_job.fit(str(tmp_path), resume=True, per_device_train_batch_size=2)


def test_import_checkpointd_does_not_import_the_frameworks() -> None:
    code = (
        "import sys, checkpointd; checkpointd.CheckpointWriter, checkpointd.restore; "
        "assert 'transformers' not in sys.modules; assert 'torchtitan' not in sys.modules"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


def test_resume_from_a_step_needs_the_restored_rng(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The straight run keeps steps 20 and 24 (save_total_limit=2); step 20 is mid-epoch 2.
    straight = transformers_job.fit(str(tmp_path / "straight"))
    root = str(tmp_path / "straight" / "checkpointd")
    with pytest.raises(InvalidArgumentError, match="holds newer steps"):
        transformers_job.fit(str(tmp_path / "straight"), resume=20)
    again = transformers_job.fit(str(tmp_path / "again"), resume=(root, 20))
    _assert_same(again, straight)
    assert [c.step for c in checkpointd.list_checkpoints(root)] == [20, 24]
    # The control: the same resume without the saved generators (dropout draws differ).
    monkeypatch.setattr(checkpointd.RNGState, "load_state_dict", lambda self, state: None)
    blind = transformers_job.fit(str(tmp_path / "blind"), resume=(root, 20))
    assert not torch.equal(blind["model.lm_head.weight"], straight["model.lm_head.weight"])


def test_a_failed_background_save_fails_train(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from checkpointd.storage.local import LocalStore

    def broken(self: LocalStore, path: str) -> None:
        raise OSError(28, "No space left on device")

    # Replacing the method skips LocalStore's own error translation: the OSError itself.
    monkeypatch.setattr(LocalStore, "make_dir", broken)
    with pytest.raises(OSError, match="No space left"):
        transformers_job.fit(str(tmp_path), max_steps=4)
    assert checkpointd.list_checkpoints(str(tmp_path / "checkpointd")) == []
