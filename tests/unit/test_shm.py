"""The service's shared-memory segments: populated at creation, in huge pages where the
kernel grants them, and readable through every mapping a client makes."""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from checkpointd import tunables
from checkpointd.daemon.wire import shm
from checkpointd.daemon.wire.shm import MappedSegment, huge_pages_mode, map_fd, readonly_fd

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd is Linux")

_SIZE = 8 * 2**20


def _smaps_field(address: int, field: str) -> int:
    """``field`` (kB) of the mapping of this process that starts at ``address``."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start = int(head.split("-")[0], 16)
            inside = start == address
        elif inside and line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping at {address:#x} with {field}")


def _address(mapped: mmap.mmap) -> int:
    """Where ``mapped`` starts (read-only mappings included; no export is left behind)."""
    return int(np.frombuffer(mapped, np.uint8).ctypes.data)


def test_a_segment_is_populated_and_shared_with_every_mapping() -> None:
    segment = MappedSegment(1, _SIZE)
    try:
        assert _smaps_field(_address(segment.map), "Rss") * 1024 >= _SIZE
        segment.view()[_SIZE - 3 :] = b"end"
        client = map_fd(readonly_fd(segment.fd), _SIZE, writable=False, populate=False)
        try:
            assert client[_SIZE - 3 :] == b"end"
        finally:
            client.close()
    finally:
        segment.close()


def test_without_populate_write_the_segment_is_mapped_populated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kernel older than 5.14 refuses MADV_POPULATE_WRITE (EINVAL): the segment is
    mapped again with MAP_POPULATE, whole and writable."""
    monkeypatch.setattr(shm, "MADV_POPULATE_WRITE", 0x7FFF)  # an advice no kernel knows
    segment = MappedSegment(2, _SIZE)
    try:
        assert _smaps_field(_address(segment.map), "Rss") * 1024 >= _SIZE
        segment.view()[:5] = b"start"
        assert os.pread(segment.fd, 5, 0) == b"start"
    finally:
        segment.close()


_GRANTS_HUGE = huge_pages_mode() in {"advise", "within_size", "always", "force"}


@pytest.mark.skipif(not _GRANTS_HUGE, reason=f"shmem_enabled is {huge_pages_mode()}")
@pytest.mark.parametrize("asked", [True, False])
def test_segments_are_huge_pages_where_the_kernel_allows(
    monkeypatch: pytest.MonkeyPatch, asked: bool
) -> None:
    """With ``advise`` a segment is in 2 MiB pages only if it asked, and a client's
    mapping of it maps them whole (what makes a restore from memory cheap)."""
    monkeypatch.setattr(tunables, "SHM_HUGE_PAGES", asked)
    size = 64 * 2**20
    segment = MappedSegment(3, size)
    try:
        client = map_fd(readonly_fd(segment.fd), size, writable=False, populate=False)
        try:
            assert bytes(client[: size : 2**20]) == bytes(64)  # touch every MiB
            mapped = _smaps_field(_address(client), "ShmemPmdMapped")
        finally:
            client.close()
    finally:
        segment.close()
    if asked or huge_pages_mode() != "advise":
        assert mapped > 0
    else:
        assert mapped == 0


def test_the_huge_pages_mode_is_the_bracketed_word(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    setting = tmp_path / "shmem_enabled"
    setting.write_text("always within_size [advise] never deny force\n")
    monkeypatch.setattr(shm, "_SHMEM_ENABLED", str(setting))
    assert huge_pages_mode() == "advise"
    setting.write_text("garbage\n")
    assert huge_pages_mode() == "unknown"
    monkeypatch.setattr(shm, "_SHMEM_ENABLED", str(tmp_path / "missing"))
    assert huge_pages_mode() == "unknown"
