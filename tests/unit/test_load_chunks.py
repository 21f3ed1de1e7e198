"""load() of a large local file: chunks faulted in, read and checksummed on several
threads, their CRC32Cs combined; still every byte checked."""

from __future__ import annotations

import os
from pathlib import Path

import crc32c as reference
import pytest
import torch

import checkpointd
from checkpointd import tunables
from checkpointd.format.checksum import crc32c_combine
from checkpointd.memory.hostmem import prefault


@pytest.mark.parametrize(("first", "second"), [(0, 5), (5, 0), (1, 1), (4097, 8 << 20), (3, 12345)])
def test_combined_crc32c_is_the_crc32c_of_the_concatenation(first: int, second: int) -> None:
    a, b = os.urandom(first), os.urandom(second)
    combined = crc32c_combine(reference.crc32c(a), reference.crc32c(b), second)
    assert combined == reference.crc32c(a + b)


@pytest.mark.parametrize("power", [29, 31, 40])
def test_combine_with_a_second_part_of_2_to_the_29_bytes_or_more(power: int) -> None:
    # Appending zeros twice must equal appending them once: the shift by 2^power bytes
    # is built from x^(2^k) for k up to power + 3 (a zlib-style table of 32 entries
    # reused modulo 32 is wrong for CRC32C's polynomial from 2^29 bytes on).
    start = reference.crc32c(b"checkpointd")
    zeros = reference.crc32c(bytes(1 << 20))
    twice = crc32c_combine(crc32c_combine(start, 0, 1 << (power - 1)), 0, 1 << (power - 1))
    assert twice == crc32c_combine(start, 0, 1 << power)
    halves = crc32c_combine(crc32c_combine(start, 0, 1 << power), zeros, 1 << 20)
    assert halves == crc32c_combine(
        start, crc32c_combine(0, zeros, 1 << 20), (1 << power) + (1 << 20)
    )


def test_prefault_keeps_the_contents() -> None:
    data = torch.arange(1 << 20, dtype=torch.int32)
    prefault(data.data_ptr() + 3, data.numel() * 4 - 3)
    assert torch.equal(data, torch.arange(1 << 20, dtype=torch.int32))


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tunables, "READ_CHUNK_BYTES", 4096)


def _tensor_file(root: Path) -> Path:
    (found,) = (root / f"{1:012d}").glob("*.safetensors")
    return found


@pytest.mark.usefixtures("small_chunks")
def test_a_file_of_many_chunks_loads_bit_exact(tmp_path: Path) -> None:
    state = {"a": torch.randn(10_001), "b": torch.arange(7, dtype=torch.int16)}
    with checkpointd.CheckpointWriter(tmp_path) as writer:
        writer.save(1, {"t": state}).result(timeout=60)
    loaded = checkpointd.load(str(tmp_path)).state["t"]
    assert torch.equal(loaded["a"], state["a"])
    assert torch.equal(loaded["b"], state["b"])


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_damage_in_any_chunk_is_found(tmp_path: Path, where: str) -> None:
    with checkpointd.CheckpointWriter(tmp_path) as writer:
        writer.save(1, {"t": {"a": torch.randn(10_001)}}).result(timeout=60)
    path = _tensor_file(tmp_path)
    data = bytearray(path.read_bytes())
    at = {"first": 0, "middle": len(data) // 2, "last": len(data) - 1}[where]
    data[at] ^= 0x01
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    with pytest.raises(checkpointd.CorruptCheckpointError):
        checkpointd.load(str(tmp_path), step=1)
