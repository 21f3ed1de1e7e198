"""The service's shared memory: every segment it holds, the memory limit, and lending.

A segment is held from ``allocate`` until ``release`` (its save failed, or the
memory tier let it go). Released segments are kept as spares, for the next saves
of a similar size (a fresh memfd costs a page fault and a zeroed page per 4 KiB on
first touch): as many as ``spares_wanted`` says (one per writer: the local ranks
sharing the service each reuse their segments), the oldest closed beyond that. A segment lent to a restoring client (``lend``) is
never written again: released while lent, it stays held (and counted) until the
last borrower gives it back (``give_back``: its connection ended), and it is
then closed, never made the spare, so no byte a client mapped ever changes under
it. On the service's event loop. No torch here.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable

import anyio

from checkpointd import tunables
from checkpointd.daemon.server.priority import lowest
from checkpointd.daemon.wire.protocol import ProtocolError
from checkpointd.daemon.wire.shm import MappedSegment, paged, reusable
from checkpointd.errors import ServiceMemoryError

__all__ = ["SharedMemory"]


class SharedMemory:
    """The segments the service holds, within ``limit`` bytes (None: no limit)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.evict: Callable[[], bool] = lambda: False
        """Frees the oldest memory-tier copy (through ``release``); False if none."""
        self.spares_wanted: Callable[[], int] = lambda: 1
        """How many released segments to keep for reuse (at least one is kept)."""
        self.segments: dict[int, MappedSegment] = {}
        self._spares: list[MappedSegment] = []  # oldest first
        self._lent: dict[int, int] = {}  # segment ident -> borrowers
        self._ever_lent: set[int] = set()
        self._released: set[int] = set()  # released while lent: closed at the last give_back
        self._pinned: dict[int, int] = {}  # segment ident -> readers (a replica being sent)
        self._unpinned: set[int] = set()  # released while pinned: released at the last unpin
        self._ids = itertools.count(1)
        self._freed = anyio.Event()
        self._creating = 0  # bytes of segments being made on a worker thread
        self._making = 0  # and how many
        self.max_segments = tunables.SERVICE_SEGMENTS
        """Most segments held at once (each a file descriptor and a mapping; admission.py)."""

    @property
    def held(self) -> int:
        """Every byte of shared memory held: staged, kept, lent, the spares and the
        segments being made."""
        return sum(s.capacity for s in self.segments.values()) + self.spare + self._creating

    @property
    def _count(self) -> int:
        """Segments held, spare or being made."""
        return len(self.segments) + len(self._spares) + self._making

    @property
    def spare(self) -> int:
        """Bytes of the spares."""
        return sum(s.capacity for s in self._spares)

    def notify(self) -> None:
        """Wake ``allocate`` and ``wait`` callers (memory or a save may have freed)."""
        self._freed.set()
        self._freed = anyio.Event()

    async def wait(self) -> None:
        """Until the next ``notify``."""
        await self._freed.wait()

    def release(self, segment: MappedSegment) -> None:
        """The segment's owner is done with it: a spare, or closed if it was ever lent
        (at its last ``give_back`` if still lent). Idempotent."""
        ident = segment.ident
        if ident not in self.segments:
            return
        if self._lent.get(ident):
            self._released.add(ident)
            return
        if self._pinned.get(ident):
            self._unpinned.add(ident)
            return
        del self.segments[ident]
        self._released.discard(ident)
        if ident in self._ever_lent:
            self._ever_lent.discard(ident)
            segment.close()
        else:
            self._spares.append(segment)
            self.trim_spares()
        self.notify()

    def trim_spares(self) -> None:
        """Close the oldest spares beyond ``spares_wanted`` (a writer went, or a release)."""
        while len(self._spares) > max(1, self.spares_wanted()):
            self._spares.pop(0).close()

    def lend(self, segment: MappedSegment) -> None:
        """A client maps ``segment`` read-only until ``give_back``: never written again."""
        self._lent[segment.ident] = self._lent.get(segment.ident, 0) + 1
        self._ever_lent.add(segment.ident)

    def give_back(self, segment: MappedSegment) -> None:
        """One borrower of ``segment`` is done (its connection ended)."""
        left = self._lent.get(segment.ident, 0) - 1
        if left > 0:
            self._lent[segment.ident] = left
            return
        self._lent.pop(segment.ident, None)
        if segment.ident in self._released:
            self.release(segment)

    def pin(self, segment: MappedSegment) -> None:
        """This service reads ``segment`` (sends it to a peer) until ``unpin``: a release
        meanwhile waits for it. Unlike ``lend`` the segment may be reused after."""
        self._pinned[segment.ident] = self._pinned.get(segment.ident, 0) + 1

    def unpin(self, segment: MappedSegment) -> None:
        """One ``pin`` of ``segment`` is over."""
        left = self._pinned.get(segment.ident, 0) - 1
        if left > 0:
            self._pinned[segment.ident] = left
            return
        self._pinned.pop(segment.ident, None)
        if segment.ident in self._unpinned:
            self._unpinned.discard(segment.ident)
            self.release(segment)

    async def allocate_now(self, nbytes: int, evict: Callable[[], bool]) -> MappedSegment | None:
        """A segment of ``nbytes`` if it fits now, after freeing spares and what ``evict``
        frees (replicas), never waiting and never evicting anything else; None if it does
        not fit (a replica that is dropped). ``check``'s errors first. A spare is reused
        only beyond ``spares_wanted``: those are the next saves' (a fresh segment costs a
        save its page faults; a replica pays them here, in the background)."""
        self.check(nbytes)
        fitting = [s for s in self._spares if reusable(s.capacity, nbytes)]
        if fitting and len(self._spares) > max(1, self.spares_wanted()):
            return self._reuse(min(fitting, key=lambda s: s.capacity), nbytes)
        size = paged(nbytes)
        limit = self.limit
        while (limit is not None and self.held + size > limit) or self._count >= self.max_segments:
            if not (self.drop_spare() or evict()):
                return None
        return await self._create(nbytes, background=True)

    def drop_spare(self) -> bool:
        """Close the oldest spare; False if there was none."""
        if not self._spares:
            return False
        self._spares.pop(0).close()
        return True

    def check(self, nbytes: int) -> None:
        """ProtocolError for a negative size; ServiceMemoryError if ``nbytes`` can never
        fit (past the limit, or past this machine's memory)."""
        limit = self.limit
        if nbytes < 0:
            raise ProtocolError(f"a segment of {nbytes} bytes was asked for")
        if limit is not None and paged(nbytes) > limit:
            raise ServiceMemoryError(
                f"this save needs {nbytes} bytes of shared memory; the service's "
                f"--memory-limit is {limit}: it can never fit (raise the limit)"
            )
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if nbytes > physical:
            raise ServiceMemoryError(
                f"this save needs {nbytes} bytes of shared memory; this machine has "
                f"{physical}: it can never fit"
            )

    async def allocate(self, nbytes: int) -> MappedSegment:
        """A new segment of ``nbytes``: evicts held checkpoints, then waits, while it would
        pass the limit; ``check``'s errors first. The wait ends only when memory frees
        (a save resolves, a client frees or gives back): the caller must not stop a
        freeing request of the same client from being served meanwhile."""
        self.check(nbytes)
        limit = self.limit
        fitting = [s for s in self._spares if reusable(s.capacity, nbytes)]
        if fitting:
            return self._reuse(min(fitting, key=lambda s: s.capacity), nbytes)
        size = paged(nbytes)  # a 1-byte segment costs a page and a descriptor
        while (limit is not None and self.held + size > limit) or self._count >= self.max_segments:
            if not (self.drop_spare() or self.evict()):
                await self.wait()  # a save in flight resolves, a client frees or gives back
        return await self._create(nbytes)

    def _reuse(self, spare: MappedSegment, nbytes: int) -> MappedSegment:
        """``spare``, taken from the spares, as a new segment of ``nbytes``."""
        self._spares.remove(spare)
        segment = spare.reuse(next(self._ids), nbytes)
        self.segments[segment.ident] = segment
        return segment

    async def _create(self, nbytes: int, *, background: bool = False) -> MappedSegment:
        """A fresh segment of ``nbytes``, counted as held from the start.

        Populating a segment takes up to a second per GB (4 KiB pages, or a host that
        backs guest memory lazily): on a worker thread, so other clients are served
        meanwhile; ``background`` (a replica's), on one at the lowest CPU priority."""
        size = paged(nbytes)
        self._creating += size
        self._making += 1
        try:
            ident = next(self._ids)
            if background:
                segment = await anyio.to_thread.run_sync(lowest, MappedSegment, ident, nbytes)
            else:
                segment = await anyio.to_thread.run_sync(MappedSegment, ident, nbytes)
        finally:
            self._creating -= size
            self._making -= 1
        self.segments[segment.ident] = segment
        return segment

    def close(self) -> None:
        """At exit: close every segment (mappings clients still have stay valid)."""
        for segment in self.segments.values():
            segment.close()
        self.segments.clear()
        while self.drop_spare():
            pass
