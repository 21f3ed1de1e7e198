"""checkpointd.integrations.lightning.CheckpointdIO inside a real ``Trainer.fit`` on CPU."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("pytorch_lightning")

import checkpointd
from checkpointd.errors import CheckpointNotFoundError, InvalidArgumentError
from checkpointd.integrations.lightning import CheckpointdIO, last_checkpoint
from checkpointd.storage.local import LocalStore
from tests.conftest import Root
from tests.support import lightning_job, zygote
from tests.support.torch_private import state_dict_metadata

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated"),
    pytest.mark.filterwarnings("ignore::lightning_fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
]

REPO = Path(__file__).resolve().parents[2]


def _job(dirpath: Path | str, out: Path | None = None, **kwargs: Any) -> subprocess.Popen[str]:
    """Start the Lightning job in a fresh process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    cmd = [sys.executable, "-m", "tests.support.lightning_job", str(dirpath)]
    cmd += ["--kwargs", json.dumps(kwargs)] + (["--out", str(out)] if out else [])
    return zygote.popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _same(a: Any, b: Any) -> bool:
    """Equal values of equal types, tensors bit for bit, recursively."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _dict_equal(a: dict[Any, Any], b: dict[Any, Any]) -> bool:
    return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)


class _Spy(CheckpointdIO):
    """Keeps a deep copy of the last dict Lightning handed over."""

    last: dict[str, Any] | None = None

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        import copy

        type(self).last = copy.deepcopy(checkpoint)
        super().save_checkpoint(checkpoint, path, storage_options)


def test_lightning_dict_round_trips_without_pickle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pytorch_lightning as pl

    monkeypatch.setattr("checkpointd.integrations.lightning.CheckpointdIO", _Spy)
    lightning_job.fit(str(tmp_path), max_epochs=1)
    assert _Spy.last is not None
    loaded = CheckpointdIO(restore_rng=False).load_checkpoint(tmp_path / "last.ckpt")
    assert _dict_equal(loaded, _Spy.last)
    assert isinstance(loaded["state_dict"], dict)
    assert state_dict_metadata(loaded["state_dict"])
    assert loaded["pytorch-lightning_version"] == pl.__version__
    names = {p.name.split(".")[-1] for p in (tmp_path / "last.ckpt").rglob("*") if p.is_file()}
    assert names <= {"json", "msgpack", "safetensors"}


def test_resume_from_last_in_fresh_process_is_bit_exact(tmp_path: Path) -> None:
    straight = lightning_job.fit(str(tmp_path / "straight"), max_epochs=2)
    lightning_job.fit(str(tmp_path / "ours"), max_epochs=1)
    lightning_job.fit(str(tmp_path / "torch"), max_epochs=1, io="torch")
    # Fresh processes with another seed: only the restored RNG state can make them match.
    ours = _job(tmp_path / "ours", tmp_path / "ours.pt", seed=99, max_epochs=2, ckpt_path="last")
    theirs = _job(
        tmp_path / "torch",
        tmp_path / "torch.pt",
        seed=99,
        max_epochs=2,
        ckpt_path="last",
        io="torch",
    )
    for proc in (ours, theirs):
        output, _ = proc.communicate(timeout=100)
        assert proc.returncode == 0, output
    resumed = torch.load(tmp_path / "ours.pt", weights_only=True)
    assert _dict_equal(resumed, straight)
    plain = torch.load(tmp_path / "torch.pt", weights_only=True)
    assert not _dict_equal(plain, straight)  # Lightning's own IO drops the RNG state


def test_save_top_k_leaves_exactly_the_kept_checkpoints(tmp_path: Path) -> None:
    # The logged score is -global_step: with mode="max" the two earliest saves stay.
    options = {"save_top_k": 2, "monitor": "score", "mode": "max", "every_n_train_steps": 2}
    lightning_job.fit(str(tmp_path), max_epochs=2, checkpoint={**options, "save_last": True})
    assert sorted(os.listdir(tmp_path)) == [
        "epoch=0-step=2.ckpt",
        "epoch=0-step=4.ckpt",
        "last.ckpt",
    ]
    io = CheckpointdIO(restore_rng=False)
    for name, step in (("epoch=0-step=2.ckpt", 2), ("epoch=0-step=4.ckpt", 4), ("last.ckpt", 16)):
        assert io.load_checkpoint(tmp_path / name)["global_step"] == step
        assert [c.step for c in checkpointd.list_checkpoints(str(tmp_path / name))] == [step]


def test_save_last_link_points_at_the_newest(tmp_path: Path) -> None:
    options = {"save_top_k": 1, "monitor": "score", "mode": "min", "every_n_train_steps": 4}
    lightning_job.fit(str(tmp_path), max_epochs=1, checkpoint={**options, "save_last": "link"})
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=8.ckpt", "last.ckpt"]
    assert os.path.islink(tmp_path / "last.ckpt")
    assert (
        CheckpointdIO(restore_rng=False).load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 8
    )


def _tiny(step: int) -> dict[str, Any]:
    return {"global_step": step, "state_dict": {"w": torch.full((4,), float(step))}}


def test_remove_waits_until_newer_save_is_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    gate.set()
    real_make_dir = LocalStore.make_dir

    def gated(self: LocalStore, path: str) -> None:
        assert gate.wait(30)
        real_make_dir(self, path)

    monkeypatch.setattr(LocalStore, "make_dir", gated)
    io = CheckpointdIO(restore_rng=False)
    old, new = tmp_path / "epoch=0-step=1.ckpt", tmp_path / "epoch=0-step=2.ckpt"
    io.save_checkpoint(_tiny(1), old)
    io.load_checkpoint(old)  # waits for it
    gate.clear()
    io.save_checkpoint(_tiny(2), new)
    io.remove_checkpoint(old)
    try:
        # step 2 is still being written: step 1 must stay
        assert [c.step for c in checkpointd.list_checkpoints(str(old))] == [1]
    finally:
        gate.set()
    io.teardown()
    assert not old.exists()
    assert io.load_checkpoint(new)["global_step"] == 2


def test_same_path_saved_twice_keeps_the_newest(tmp_path: Path) -> None:
    io = CheckpointdIO(restore_rng=False)
    io.save_checkpoint(_tiny(5), tmp_path / "last.ckpt")
    io.save_checkpoint({**_tiny(5), "extra": 1}, tmp_path / "last.ckpt")
    io.teardown()
    assert io.load_checkpoint(tmp_path / "last.ckpt")["extra"] == 1
    assert [c.step for c in checkpointd.list_checkpoints(str(tmp_path / "last.ckpt"))] == [6]
    with pytest.raises(CheckpointNotFoundError):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    with pytest.raises(InvalidArgumentError):
        CheckpointdIO(keep_last=3)


def test_a_bad_writer_option_is_refused_when_the_plugin_is_made() -> None:
    with pytest.raises(InvalidArgumentError, match="max_pending must be a positive int, not 0"):
        CheckpointdIO(max_pending=0)
    assert CheckpointdIO(max_concurrency=2, chunk_bytes=2**20).options.keep_last == 1


def test_top_k_rotation_reuses_one_staging_buffer_and_deletes_in_background(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Lightning's top-k saves go to a new path (a new root, a new writer) every time:
    # a fresh staging buffer each time costs a first touch of every page on the training
    # thread, and so would deleting the replaced checkpoint there.
    from checkpointd.write.capture import StagingBuffer

    made: list[StagingBuffer] = []
    real_init = StagingBuffer.__init__

    def counted(self: StagingBuffer) -> None:
        real_init(self)
        made.append(self)

    monkeypatch.setattr(StagingBuffer, "__init__", counted)
    deleted_on: list[str] = []
    real_rmtree = shutil.rmtree

    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        deleted_on.append(threading.current_thread().name)
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    handles: list[checkpointd.SaveHandle] = []  # each save the plugin makes
    real_save = checkpointd.CheckpointWriter.save

    def save(self: checkpointd.CheckpointWriter, *args: Any, **kwargs: Any) -> Any:
        handles.append(real_save(self, *args, **kwargs))
        return handles[-1]

    monkeypatch.setattr(checkpointd.CheckpointWriter, "save", save)
    io = CheckpointdIO(restore_rng=False)
    paths = [tmp_path / f"epoch=0-step={step}.ckpt" for step in range(1, 7)]
    for step, path in enumerate(paths, 1):
        io.save_checkpoint(_tiny(step), path)
        if step > 1:
            io.remove_checkpoint(paths[step - 2])
        handles[-1].result(30)  # the next save finds the previous one done
    io.teardown()
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=6.ckpt"]
    # Two: the new save is taken before the replaced root is removed (6 without the pool).
    assert sum(buffer.allocations for buffer in made) == 2
    assert len(deleted_on) >= 5  # each removed root, on the deletion thread
    assert threading.main_thread().name not in deleted_on


def test_s3_save_load_remove(s3_root: Root) -> None:
    io = CheckpointdIO(storage_options=s3_root.storage_options, restore_rng=False)
    first, last = f"{s3_root.url}/epoch=0-step=1.ckpt", f"{s3_root.url}/last.ckpt"
    io.save_checkpoint(_tiny(1), first)
    io.save_checkpoint(_tiny(2), last)
    io.remove_checkpoint(first)
    io.teardown()
    assert torch.equal(io.load_checkpoint(last)["state_dict"]["w"], torch.full((4,), 2.0))
    with pytest.raises(CheckpointNotFoundError):
        io.load_checkpoint(first)


def test_kill9_during_fit_leaves_only_loadable_checkpoints(tmp_path: Path) -> None:
    options = {"save_top_k": 2, "monitor": "score", "mode": "min", "every_n_train_steps": 1}
    proc = _job(tmp_path, max_epochs=1000, checkpoint={**options, "save_last": True})
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            infos = (
                checkpointd.list_checkpoints(str(tmp_path / "last.ckpt"))
                if (tmp_path / "last.ckpt").exists()
                else []
            )
            if infos and infos[-1].step >= 20:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[0]
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    io = CheckpointdIO(restore_rng=False)
    loadable = 0
    for entry in sorted(tmp_path.iterdir()):
        try:
            checkpoint = io.load_checkpoint(entry)
        except CheckpointNotFoundError:
            assert entry.name != "last.ckpt"  # a save cut short: nothing committed, nothing to pick
            continue
        loadable += 1
        assert set(checkpoint) >= {"state_dict", "optimizer_states", "loops", "callbacks"}
    assert loadable >= 2


def test_unified_lightning_package(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    lightning_job.fit(str(tmp_path), max_epochs=1, name="lightning")
    assert (
        CheckpointdIO(restore_rng=False).load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 8
    )


def test_benchmark_runs_in_its_smallest_mode() -> None:
    from benchmarks import bench_lightning

    tiny = ["--repeat", "1", "--steps", "4", "--every", "2", "--width", "16", "--layers", "1"]
    summary = bench_lightning.main(tiny)
    assert set(summary) == {"torch", "async", "checkpointd"}
    assert all(row["saves"] == 2 and row["blocked_ms"] > 0 for row in summary.values())


def _s3_env(root: Root) -> dict[str, str]:
    """The environment s3fs (through botocore) reads: what Lightning's own fs calls use."""
    options = root.storage_options
    return {
        "AWS_ACCESS_KEY_ID": options["key"],
        "AWS_SECRET_ACCESS_KEY": options["secret"],
        "AWS_ENDPOINT_URL": options["client_kwargs"]["endpoint_url"],
        "AWS_DEFAULT_REGION": options["client_kwargs"]["region_name"],
    }


def test_s3_fit_then_resume_from_last_in_fresh_process_is_bit_exact(
    s3_root: Root, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in _s3_env(s3_root).items():
        monkeypatch.setenv(name, value)
    io_options = {"storage_options": s3_root.storage_options}
    straight = lightning_job.fit(f"{s3_root.url}/straight", max_epochs=2, io_options=io_options)
    lightning_job.fit(f"{s3_root.url}/ours", max_epochs=1, io_options=io_options)
    last = last_checkpoint(f"{s3_root.url}/ours", storage_options=s3_root.storage_options)
    assert last == f"{s3_root.url}/ours/last.ckpt"
    assert last_checkpoint(f"{s3_root.url}/none", storage_options=s3_root.storage_options) is None
    job = _job(
        f"{s3_root.url}/ours",
        tmp_path / "ours.pt",
        seed=99,
        max_epochs=2,
        ckpt_path=last,
        io_options=io_options,
    )
    output, _ = job.communicate(timeout=100)
    assert job.returncode == 0, output
    assert _dict_equal(torch.load(tmp_path / "ours.pt", weights_only=True), straight)
