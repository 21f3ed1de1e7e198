"""Direct I/O writes: what is written is exactly the bytes, aligned or not, on any file system."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
import safetensors
import torch

import checkpointd
from checkpointd import tunables
from checkpointd.storage import LocalStore
from checkpointd.storage.directio import DIRECT_ALIGN, address, write_direct
from checkpointd.write.capture import StagingBuffer
from tests.support.files import component_file


def _aligned(nbytes: int, skew: int = 0) -> memoryview:
    raw = torch.randint(0, 256, (nbytes + 2 * DIRECT_ALIGN,), dtype=torch.uint8)
    start = -raw.data_ptr() % DIRECT_ALIGN + skew
    view = raw.numpy().data.cast("B")[start : start + nbytes]
    assert address(view) % DIRECT_ALIGN == skew
    return view


@pytest.mark.parametrize(
    ("nbytes", "skew", "position", "expect_direct"),
    [
        (tunables.DIRECT_MIN_BYTES + 100, 0, 0, True),  # aligned prefix direct, tail returned
        (tunables.DIRECT_MIN_BYTES, 8, 0, False),  # misaligned address
        (tunables.DIRECT_MIN_BYTES, 0, 4, False),  # misaligned file position
        (tunables.DIRECT_MIN_BYTES - DIRECT_ALIGN, 0, 0, False),  # too small to bother
    ],
)
def test_write_direct_leaves_exact_bytes(
    tmp_path: Path, nbytes: int, skew: int, position: int, expect_direct: bool
) -> None:
    data = _aligned(nbytes, skew)
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, b"p" * position)
        rest, _ = write_direct(fd, data)
        written = len(data) - len(rest)
        assert (written > 0) == expect_direct
        if expect_direct:
            assert written % DIRECT_ALIGN == 0
        while rest:
            rest = rest[os.write(fd, rest) :]
        os.fsync(fd)
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        assert not flags & getattr(os, "O_DIRECT", 0), "O_DIRECT must be cleared again"
    finally:
        os.close(fd)
    assert path.read_bytes() == b"p" * position + bytes(data)


def test_local_sink_writes_large_views_exactly(tmp_path: Path) -> None:
    store = LocalStore(str(tmp_path))
    header = b"h" * DIRECT_ALIGN
    data = _aligned(3 * tunables.DIRECT_MIN_BYTES + 12345)
    sink = store.open_file("x.bin")
    sink.write(header)
    sink.write(data)
    sink.commit()
    assert (tmp_path / "x.bin").read_bytes() == header + bytes(data)


def test_staging_arena_is_block_aligned() -> None:
    buffer = StagingBuffer()
    arena = buffer.reserve(5 * DIRECT_ALIGN + 3, pinned=False)
    assert arena.data_ptr() % DIRECT_ALIGN == 0
    assert arena.numel() >= 5 * DIRECT_ALIGN + 3


def test_large_checkpoint_round_trips_and_stays_safetensors(tmp_path: Path) -> None:
    state = {
        "w": torch.randn(3 * tunables.DIRECT_MIN_BYTES // 4 + 7),
        "b": torch.arange(1000, dtype=torch.int16),
        "e": torch.randn(0),
    }
    with checkpointd.CheckpointWriter(str(tmp_path)) as writer:
        writer.save(1, {"model": state, "small": {"x": torch.ones(3)}}).result()
        writer.save(2, {"model": state, "small": {"x": torch.ones(3)}}).result()
    loaded = checkpointd.load(str(tmp_path), 2).state["model"]
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor)
    path = tmp_path / f"{2:012d}" / component_file(str(tmp_path), 2, "model")
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert (8 + header_len) % DIRECT_ALIGN == 0  # data region aligned for direct I/O
    with safetensors.safe_open(str(path), "pt") as f:
        assert torch.equal(f.get_tensor("w"), state["w"])
        assert torch.equal(f.get_tensor("b"), state["b"])
