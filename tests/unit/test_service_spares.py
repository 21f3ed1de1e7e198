"""The service's spare segments: one per writer is kept for reuse, so local ranks sharing
one service each get an already-populated segment again at their next save."""

from __future__ import annotations

import sys

import anyio
import pytest

from checkpointd.daemon.server.memory import SharedMemory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd is Linux")

_SIZE = 2 * 2**20


def test_each_writer_gets_its_released_segment_again() -> None:
    async def main() -> None:
        memory = SharedMemory(limit=None)
        writers = 2
        memory.spares_wanted = lambda: writers
        first = [await memory.allocate(_SIZE) for _ in range(writers)]
        fds = {s.fd for s in first}
        for segment in first:
            memory.release(segment)  # both committed and let go by the memory tier
        assert memory.spare == writers * _SIZE
        again = [await memory.allocate(_SIZE) for _ in range(writers)]
        assert {s.fd for s in again} == fds  # the same memfds, not new ones
        assert memory.spare == 0
        assert memory.held == writers * _SIZE
        memory.close()

    anyio.run(main)


def test_spares_beyond_the_writers_are_closed() -> None:
    async def main() -> None:
        memory = SharedMemory(limit=None)
        writers = 3
        memory.spares_wanted = lambda: writers
        segments = [await memory.allocate(_SIZE) for _ in range(3)]
        for segment in segments:
            memory.release(segment)
        assert memory.spare == 3 * _SIZE
        writers = 1  # two writers closed
        memory.trim_spares()
        assert memory.spare == _SIZE
        assert [s.fd for s in segments[:2]] == [-1, -1]  # the oldest two were closed
        assert segments[2].fd >= 0
        memory.close()

    anyio.run(main)


def test_the_limit_drops_spares_before_waiting() -> None:
    async def main() -> None:
        memory = SharedMemory(limit=3 * _SIZE)
        memory.spares_wanted = lambda: 2
        a, b = await memory.allocate(_SIZE), await memory.allocate(_SIZE)
        memory.release(a)
        memory.release(b)
        with anyio.fail_after(10):
            big = await memory.allocate(3 * _SIZE)  # fits only once both spares are gone
        assert memory.spare == 0
        assert memory.held == 3 * _SIZE
        assert big.capacity == 3 * _SIZE
        memory.close()

    anyio.run(main)
