"""Retention never leaves a root without a checkpoint that verifies when it had one.

``gc`` (a real subprocess) reads every step it counts before deleting; a writer
checks the step it just committed is still whole on storage before its retention
deletes the previous one. The writer's damage comes from a real store that loses
the tail of a file once the step's manifest is published (a disk or file server
that acknowledged bytes it did not keep), registered as a backend of its own.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

import checkpointd
from checkpointd.cli import main as cli
from checkpointd.errors import CheckpointWarning, CorruptCheckpointError, RetentionWarning
from checkpointd.format.layout import MANIFEST_NAME, step_dirname
from checkpointd.storage import LocalStore, register_store

REPO = Path(__file__).resolve().parents[2]


def _state(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(128, 64, generator=gen)}}


def _steps(root: str) -> list[int]:
    return [c.step for c in checkpointd.list_checkpoints(root)]


def _commit(root: str, *steps: int) -> None:
    with checkpointd.CheckpointWriter(root) as writer:  # no retention
        for step in steps:
            writer.save(step, _state(step)).result(timeout=60)


def _flip_a_data_byte(root: str, step: int) -> None:
    (path,) = glob.glob(os.path.join(root, step_dirname(step), "model*.safetensors"))
    data = bytearray(Path(path).read_bytes())
    data[-7] ^= 0x01  # inside the tensor bytes: only a CRC32C over them sees it
    Path(path).write_bytes(bytes(data))


def _gc(root: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    return subprocess.run(
        [sys.executable, "-m", "checkpointd", "gc", root, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
        cwd=REPO,
    )


def test_gc_keeps_the_newest_intact_step_when_the_newest_is_damaged(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    _commit(root, 1, 2, 3)
    _flip_a_data_byte(root, 3)

    done = _gc(root, "--keep-last", "1", "--apply")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step 3 fails verification" in done.stderr
    assert "CRC32C" in done.stderr
    assert "keeping step 2 in its place (verified)" in done.stderr
    assert "  keep    step          2  (newest, last)  verified" in done.stdout
    assert "  keep    step          3  (damaged)" in done.stdout
    assert "  delete  step          1" in done.stdout
    assert _steps(root) == [2, 3]
    with pytest.warns(CheckpointWarning, match="skipping step 3"):
        loaded = checkpointd.load(root)
    assert loaded.info.step == 2
    assert torch.equal(loaded.state["model"]["w"], _state(2)["model"]["w"])

    # With nothing damaged among what it counts, gc proceeds as before.
    _commit(root, 4)
    done = _gc(root, "--keep-last", "1", "--apply")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert _steps(root) == [4]


def test_gc_deletes_no_checkpoint_when_none_verifies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(tmp_path / "ckpt")
    _commit(root, 1, 2, 3)
    for step in (1, 2, 3):
        _flip_a_data_byte(root, step)
    assert cli.main(["gc", root, "--keep-last", "1", "--apply"]) == 1
    err = capsys.readouterr().err
    assert all(f"step {s} fails verification" in err for s in (1, 2, 3))
    assert "deleting no checkpoint" in err
    assert _steps(root) == [1, 2, 3]


# --- a writer whose just-committed step is damaged before its retention runs ------


class LosingStore(LocalStore):
    """A local folder whose storage loses the tail of a step's tensor file right after
    the step's manifest is published (``storage_options={"lose": STEP}``)."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__(url.removeprefix("losing://"))
        self.url = url
        self.lose = (storage_options or {}).get("lose")

    def publish(self, path: str, data: bytes) -> None:
        super().publish(path, data)
        if self.lose is not None and path == f"{step_dirname(self.lose)}/{MANIFEST_NAME}":
            (tensors,) = glob.glob(
                os.path.join(self.root, step_dirname(self.lose), "model*.safetensors")
            )
            os.truncate(tensors, os.path.getsize(tensors) // 2)


register_store("losing", LosingStore)


def test_writer_retention_keeps_the_previous_step_when_its_commit_is_damaged(
    tmp_path: Path,
) -> None:
    url = f"losing://{tmp_path / 'ckpt'}"
    with checkpointd.CheckpointWriter(url, keep_last=1, storage_options={"lose": 2}) as writer:
        writer.save(1, _state(1)).result(timeout=60)
        with pytest.warns(RetentionWarning, match=r"step 2 does not check out .*keeping step 1"):
            writer.save(2, _state(2)).result(timeout=60)
        assert _steps(url) == [1, 2]  # before: [2], and nothing loaded
        with pytest.warns(CheckpointWarning, match="skipping step 2"):
            loaded = checkpointd.load(url)
        assert loaded.info.step == 1
        assert torch.equal(loaded.state["model"]["w"], _state(1)["model"]["w"])
        with pytest.raises(CorruptCheckpointError):
            checkpointd.load(url, 2)

        # The next intact commit counts again: the damaged step and the fallback go.
        writer.save(3, _state(3)).result(timeout=60)
        assert _steps(url) == [3]
    assert torch.equal(checkpointd.load(url).state["model"]["w"], _state(3)["model"]["w"])
