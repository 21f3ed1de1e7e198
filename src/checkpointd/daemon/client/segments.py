"""The trainer's side of the service's shared memory: the staging buffer whose arena is
a service segment (``SegmentBuffer``), and the mappings of the last segments it used
(``Mappings``), kept so a reused segment is not set up page by page again. Imports
torch."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from concurrent.futures import Future
from typing import Any

import torch

from checkpointd import tunables
from checkpointd.daemon.client.client import Connection
from checkpointd.daemon.wire import protocol as p
from checkpointd.daemon.wire.shm import map_fd, reusable
from checkpointd.errors import CheckpointError, ServiceError
from checkpointd.write.capture import StagingBuffer

__all__ = ["Mappings", "SegmentBuffer"]


class Mappings:
    """This process's mappings of the last segments it captured into, by memfd inode.

    The service hands a freed segment out again for the next save of a similar
    size; mapping it anew would set up every page again (measured: the main cost
    of ``save()`` over the in-process writer). Only the last
    ``tunables.CLIENT_MAPS_KEPT`` are kept: in
    steady state those are the segment being filled and the one the service keeps
    in memory (or as its spare), so no memory stays alive only because of us for
    longer than one save. Any thread."""

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int], mmap.mmap] = {}
        self._lock = threading.Lock()

    def map(self, fd: int, size: int) -> mmap.mmap:
        """A writable mapping of at least ``size`` bytes of segment ``fd`` (closed here)."""
        try:
            info = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        key = (info.st_dev, info.st_ino)
        with self._lock:
            found = self._maps.pop(key, None)
        if found is not None and len(found) >= max(size, 1):
            os.close(fd)
        else:
            if found is not None:
                _unmap(found)
            found = map_fd(fd, size, writable=True)
        with self._lock:
            self._maps[key] = found
            while len(self._maps) > tunables.CLIENT_MAPS_KEPT:
                _unmap(self._maps.pop(next(iter(self._maps))))
        return found

    def close(self) -> None:
        with self._lock:
            maps, self._maps = list(self._maps.values()), {}
        for mapped in maps:
            _unmap(mapped)


def _unmap(mapped: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # tensors over it still alive: unmapped when
        mapped.close()  # they go


class SegmentBuffer(StagingBuffer):
    """A staging buffer whose arena is a new service segment at each reserve.

    ``ahead``: a size to ask the service for at once (the previous save's), so that the
    round trip overlaps the capture's walk of the state; the capture takes that segment
    if it fits what it needs (at most twice as large, as the service reuses a spare),
    else gives it back and asks for its own."""

    def __init__(self, conn: Connection, mappings: Mappings, ahead: int | None = None) -> None:
        super().__init__(self._allocate)
        self._conn = conn
        self._mappings = mappings
        self.segment: int | None = None
        self.nbytes = 0
        """Bytes the last reserve asked for."""
        self._pinned: int | None = None  # the address registered with CUDA
        self._ahead = None if ahead is None else (ahead, conn.start(p.Alloc, nbytes=ahead))

    def _allocate(self, nbytes: int, pinned: bool) -> torch.Tensor:
        self.forget()
        reply, fd = self._take_ahead(nbytes) or self._conn.request(p.Alloc, nbytes=nbytes)
        assert isinstance(reply, p.Segment)
        assert fd is not None
        self.segment, self.nbytes = reply.segment, nbytes
        mapped = self._mappings.map(fd, reply.size)
        arena = torch.frombuffer(mapped, dtype=torch.uint8, count=max(nbytes, 1))
        if pinned and torch.cuda.is_available():
            _cudart().cudaHostRegister(arena.data_ptr(), arena.numel(), 0)
            self._pinned = arena.data_ptr()
        return arena[:nbytes] if nbytes else arena

    def _take_ahead(self, nbytes: int) -> tuple[p.Message, int | None] | None:
        """The segment asked for ahead if it fits ``nbytes``; else None (given back)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        size, future = ahead
        if reusable(size, nbytes):
            try:
                return future.result()
            except CheckpointError:  # refused at that size: ask for what is needed
                return None
        _give_back(self._conn, future)
        return None

    def cancel_ahead(self) -> None:
        """Give back the segment asked for ahead if no reserve took it (the capture
        failed first); it need not have arrived yet."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            _give_back(self._conn, ahead[1])

    def forget(self) -> None:
        """Drop the arena; the segment is no longer ours (its mapping stays in
        ``_Mappings`` for a later save that gets the same segment again)."""
        self.drop()
        self.segment = None
        if self._pinned is not None:
            _cudart().cudaHostUnregister(self._pinned)
            self._pinned = None


def _give_back(conn: Connection, future: Future[tuple[p.Message, int | None]]) -> None:
    """Free the segment ``future`` brings once it arrives (on the connection's reader
    thread if it has not yet), without waiting for the service's answer."""

    def free(done: Future[tuple[p.Message, int | None]]) -> None:
        if done.exception() is not None:
            return
        reply, fd = done.result()
        if fd is not None:
            os.close(fd)
        assert isinstance(reply, p.Segment)
        with contextlib.suppress(ServiceError):  # gone: its memory went with it
            ident = conn.new_id()
            conn.post(ident, p.encode(p.Free(ident, reply.segment)))

    future.add_done_callback(free)


def _cudart() -> Any:
    """The CUDA runtime, to page-lock a segment for CUDA sources (cudaHostRegister) so
    their copies stay DMA, and to unlock it before it is unmapped."""
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]
