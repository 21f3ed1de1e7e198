"""A restore from the memory tier checks each tensor file as it lands (read/landing.py,
a ``MappedFile``), without a service: a held copy built by hand from a checkpoint on
disk, with one byte flipped in a tensor that lands straight in its live tensor or in
one that is loaded by ``load_state_dict``."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

import checkpointd
from checkpointd.daemon.client.memstore import MemoryStore
from checkpointd.daemon.wire.protocol import HeldFile
from checkpointd.errors import CorruptCheckpointError
from checkpointd.format.checksum import crc32c
from checkpointd.format.header import header_length, parse_safetensors_header
from checkpointd.format.layout import MANIFEST_NAME, step_dirname
from checkpointd.read.restore import restore_from


class _Model(torch.nn.Module):
    """A contiguous weight (lands in place) and a transposed one (loaded by copying)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.direct = torch.nn.Parameter(torch.randn(64, 256, generator=generator))
        self.loaded = torch.nn.Parameter(torch.randn(256, 64, generator=generator).t())


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    with checkpointd.CheckpointWriter(str(root)) as writer:
        writer.save(1, {"model": _Model(seed=0)}).result(30)
    return root


def _tensor_file(root: Path) -> Path:
    (found,) = (root / step_dirname(1)).glob("model*.safetensors")
    return found


@pytest.fixture
def held(saved: Path) -> tuple[MemoryStore, mmap.mmap, dict[str, int]]:
    """Every file of step 1 in one anonymous mapping, as the service holds a copy; where
    each file starts in it. (The mapping is freed with the store's views of it.)"""
    folder = saved / step_dirname(1)
    files = sorted(p for p in folder.iterdir() if p.name != MANIFEST_NAME)
    mapped = mmap.mmap(-1, sum(p.stat().st_size for p in files))
    starts: dict[str, int] = {}
    entries: list[HeldFile] = []
    at = 0
    for path in files:
        data = path.read_bytes()
        mapped[at : at + len(data)] = data
        starts[path.name] = at
        entries.append(HeldFile(path.name, b"", at, len(data), crc32c(data)))
        at += len(data)
    manifest = (folder / MANIFEST_NAME).read_bytes()
    store = MemoryStore.over(str(saved), step_dirname(1), manifest, entries, mapped)
    return store, mapped, starts


def _flip(mapped: mmap.mmap, at: int) -> None:
    mapped[at] ^= 0xFF


def _middle_of(root: Path, name: str) -> int:
    """Offset in the tensor file of the middle byte of tensor ``name``."""
    data = _tensor_file(root).read_bytes()
    length = header_length(data[:8], len(data), where="test")
    entries = parse_safetensors_header(data[8 : 8 + length], len(data) - 8 - length, where="t")
    (entry,) = [e for e in entries if e.name == name]
    return 8 + length + (entry.begin + entry.end) // 2


def test_an_intact_held_copy_restores_bit_exact(
    saved: Path, held: tuple[MemoryStore, mmap.mmap, dict[str, int]]
) -> None:
    store, _, _ = held
    target = _Model(seed=1)
    restore_from(store, {"model": target}, 1, True)
    expected = _Model(seed=0)
    assert torch.equal(target.direct, expected.direct)
    assert torch.equal(target.loaded, expected.loaded)
    assert not target.loaded.is_contiguous()  # loaded by copying, not landed in place


@pytest.mark.parametrize("damaged", ["direct", "loaded"])
def test_a_damaged_held_copy_fails_as_it_lands_and_the_loaded_state_is_rolled_back(
    saved: Path, held: tuple[MemoryStore, mmap.mmap, dict[str, int]], damaged: str
) -> None:
    store, mapped, starts = held
    _flip(mapped, starts[_tensor_file(saved).name] + _middle_of(saved, damaged))
    target = _Model(seed=1)
    before = target.loaded.detach().clone()
    with pytest.raises(CorruptCheckpointError, match="does not match the manifest") as failed:
        restore_from(store, {"model": target}, 1, True)
    assert "may hold a mix" in str(failed.value)
    assert "['model']" in str(failed.value)
    # what load_state_dict copied (the damaged tensor too) is put back as it was
    assert torch.equal(target.loaded, before)


class _Pair(torch.nn.Module):
    """Two weights of one shape and dtype: both land in place."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.w1 = torch.nn.Parameter(torch.randn(32, 64, generator=generator))
        self.w2 = torch.nn.Parameter(torch.randn(32, 64, generator=generator))


class _HeaderRestored(MemoryStore):
    """A held copy whose tensor file's header is written back to ``original`` (at
    ``base`` of ``mapped``) right after a read of it: what was read before is not what
    is there afterwards."""

    target = ""
    original = b""
    base = 0
    mapped: mmap.mmap | None = None

    def read_into(self, path: str, buffer: memoryview, offset: int = 0) -> None:
        super().read_into(path, buffer, offset)
        if path == self.target and offset == 8 and self.mapped is not None:
            at = self.base + 8
            self.mapped[at : at + len(self.original)] = self.original


def test_a_header_written_into_between_its_read_and_its_check_is_refused(
    tmp_path: Path,
) -> None:
    """The layout a landing is planned on must be the header that is checked: names
    swapped in memory while the header is read, then swapped back before the file is
    checked as it lands, would put each weight's bytes in the other weight."""
    root = tmp_path / "root"
    with checkpointd.CheckpointWriter(str(root)) as writer:
        writer.save(1, {"model": _Pair(seed=0)}).result(30)
    folder = root / step_dirname(1)
    files = sorted(p for p in folder.iterdir() if p.name != MANIFEST_NAME)
    mapped = mmap.mmap(-1, sum(p.stat().st_size for p in files))
    entries: list[HeldFile] = []
    at = 0
    for path in files:
        data = path.read_bytes()
        mapped[at : at + len(data)] = data
        if path.name.endswith(".safetensors"):
            tensor_file, base = path.name, at
            length = header_length(data[:8], len(data), where="test")
            original = data[8 : 8 + length]
        entries.append(HeldFile(path.name, b"", at, len(data), crc32c(data)))
        at += len(data)
    assert original.count(b'"w1"') == original.count(b'"w2"') == 1
    swapped = original.replace(b'"w1"', b'"w?"').replace(b'"w2"', b'"w1"').replace(b'"w?"', b'"w2"')
    mapped[base + 8 : base + 8 + length] = swapped
    manifest = (folder / MANIFEST_NAME).read_bytes()
    store = _HeaderRestored.over(str(root), step_dirname(1), manifest, entries, mapped)
    store.target, store.base, store.original = f"{step_dirname(1)}/{tensor_file}", base, original
    store.mapped = mapped
    target = _Pair(seed=1)
    with pytest.raises(CorruptCheckpointError, match="header changed after it was read"):
        restore_from(store, {"model": target}, 1, True)
    assert mapped[base + 8 : base + 8 + length] == original  # the check saw the header intact
