"""Loading large local files: checked, owned by the caller, never written back, never mapped.

(Loads used to map large files; a restored optimizer then kept a deleted
checkpoint's disk space until the process exited.)"""

from __future__ import annotations

import gc
import shutil
from pathlib import Path

import pytest
import torch

import checkpointd
from checkpointd.errors import CorruptCheckpointError
from checkpointd.read.catalog import read_manifest
from checkpointd.read.reader import StepReader
from checkpointd.storage import open_store
from tests.support.files import component_file


def _save(root: Path) -> tuple[dict[str, torch.Tensor], Path]:
    state = {"w": torch.randn(2**19), "i": torch.arange(10, dtype=torch.int64)}  # 2 MiB + 80 B
    with checkpointd.CheckpointWriter(str(root)) as writer:
        writer.save(1, {"model": state}).result()
    return state, root / f"{1:012d}" / component_file(str(root), 1, "model")


def test_large_load_is_exact_and_owned_by_the_caller(tmp_path: Path) -> None:
    state, path = _save(tmp_path)
    before = path.read_bytes()
    loaded = checkpointd.load(str(tmp_path)).state["model"]
    assert torch.equal(loaded["w"], state["w"])
    assert torch.equal(loaded["i"], state["i"])
    loaded["w"].add_(1.0)  # the caller owns what load returns
    assert path.read_bytes() == before
    again = checkpointd.load(str(tmp_path)).state["model"]
    assert torch.equal(again["w"], state["w"])


def test_large_load_detects_a_flipped_byte(tmp_path: Path) -> None:
    _, path = _save(tmp_path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="CRC32C"):
        checkpointd.load(str(tmp_path))


def test_large_load_detects_a_truncated_file(tmp_path: Path) -> None:
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
    reader = StepReader(store, 1, manifest, verify=True)
    with pytest.raises(checkpointd.CheckpointNotFoundError, match="deleted while"):
        reader.read(name)


def _file_mappings(folder: Path) -> list[str]:
    """Lines of /proc/self/maps that map a file under ``folder`` (deleted or not)."""
    prefix = str(folder.resolve())
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if prefix in line]


def _trained_adamw() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(512, 512)  # 1 MiB of weights, 2 MiB of AdamW state: both big
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 512)).sum().backward()
    optimizer.step()
    return model, optimizer


needs_proc_maps = pytest.mark.skipif(
    not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps (Linux)"
)


@needs_proc_maps
def test_restored_objects_hold_no_view_of_the_checkpoint_files(tmp_path: Path) -> None:
    """Retention must be able to free a restored checkpoint's disk space at once."""
    root = tmp_path / "ckpt"
    model, optimizer = _trained_adamw()
    with checkpointd.CheckpointWriter(str(root)) as writer:
        writer.save(1, {"model": model, "opt": optimizer}).result(timeout=60)
    sizes = [p.stat().st_size for p in (root / f"{1:012d}").glob("*.safetensors")]
    assert min(sizes) >= 1 << 20, "files too small to exercise the large-file path"
    fresh, fresh_opt = _trained_adamw()
    checkpointd.restore(str(root), {"model": fresh, "opt": fresh_opt})
    shutil.rmtree(root)  # as retention would
    gc.collect()
    assert _file_mappings(tmp_path) == []
    state = fresh_opt.state_dict()["state"][0]
    assert torch.equal(state["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])


@needs_proc_maps
def test_loaded_tensors_hold_no_view_of_the_checkpoint_files(tmp_path: Path) -> None:
    state, path = _save(tmp_path)
    loaded = checkpointd.load(str(tmp_path)).state["model"]
    shutil.rmtree(path.parent)
    gc.collect()
    assert _file_mappings(tmp_path) == []
    assert torch.equal(loaded["w"], state["w"])
