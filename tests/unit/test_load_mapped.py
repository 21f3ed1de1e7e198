"""Loading large local files through a private memory map: checked, and never written back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import checkpointd
from checkpointd.catalog import read_manifest
from checkpointd.errors import CorruptCheckpointError
from checkpointd.restore import _Reader
from checkpointd.storage import open_store
from tests.support.files import component_file


def _save(root: Path) -> tuple[dict[str, torch.Tensor], Path]:
    state = {"w": torch.randn(2**19), "i": torch.arange(10, dtype=torch.int64)}  # 2 MiB + 80 B
    with checkpointd.CheckpointWriter(str(root)) as writer:
        writer.save(1, {"model": state}).result()
    return state, root / f"{1:012d}" / component_file(str(root), 1, "model")


def test_mapped_load_is_exact_and_copy_on_write(tmp_path: Path) -> None:
    state, path = _save(tmp_path)
    before = path.read_bytes()
    loaded = checkpointd.load(str(tmp_path)).state["model"]
    assert torch.equal(loaded["w"], state["w"])
    assert torch.equal(loaded["i"], state["i"])
    loaded["w"].add_(1.0)  # the caller owns what load returns
    assert path.read_bytes() == before
    again = checkpointd.load(str(tmp_path)).state["model"]
    assert torch.equal(again["w"], state["w"])


def test_mapped_load_detects_a_flipped_byte(tmp_path: Path) -> None:
    _, path = _save(tmp_path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="CRC32C"):
        checkpointd.load(str(tmp_path))


def test_mapped_load_detects_a_truncated_file(tmp_path: Path) -> None:
    _, path = _save(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 4096)
    with pytest.raises(CorruptCheckpointError, match="size"):
        checkpointd.load(str(tmp_path))


def test_checkpoint_deleted_while_loading_is_not_found_not_corrupt(tmp_path: Path) -> None:
    """Retention removing the manifest first means a half-deleted step reads as gone."""
    root = tmp_path / "ckpt"
    with checkpointd.CheckpointWriter(str(root)) as writer:
        writer.save(1, {"m": {"w": torch.ones(10)}}).result(timeout=30)
    folder = root / "000000000001"
    store = open_store(str(root))
    manifest = read_manifest(store, 1)
    (folder / "manifest.json").unlink()  # as retention does first
    name = manifest.components["m"].tensors[0]
    (folder / name).unlink()
    reader = _Reader(store, 1, manifest, verify=True)
    with pytest.raises(checkpointd.CheckpointNotFoundError, match="deleted while"):
        reader.read(name)
