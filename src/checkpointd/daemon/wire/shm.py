"""Shared-memory segments: memfd files the service creates, sized once, mapped by both sides.

A segment has no name anyone could guess or open: it exists only as file
descriptors, passed to a client over the socket (SCM_RIGHTS). The service maps
each segment it hands out; a client maps the fd it received (read-write to
capture into, read-only to restore from) and closes the fd. The memory is freed
once every mapping and fd is gone. No torch here.

Segments ask the kernel for transparent huge pages (``MADV_HUGEPAGE``), which
Linux grants where ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` is
``advise``, ``within_size`` or ``always``. Every mapping of a huge-page segment
then sets up 2 MiB per fault instead of 4 KiB: a restarted trainer maps a held
605 MB checkpoint in under a millisecond instead of ~0.07 s (measured on the
README's VM), which is what the memory tier's restore is bound by. Under
``never`` (many distributions' default) the advice does nothing.
"""

from __future__ import annotations

import contextlib
import mmap
import os

from checkpointd import tunables
from checkpointd.errors import ServiceError
from checkpointd.memory.hostmem import MADV_POPULATE_WRITE

__all__ = ["MappedSegment", "huge_pages_mode", "map_fd", "paged", "readonly_fd", "reusable"]

_SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


class MappedSegment:
    """One segment as the service holds it: its fd and its (read-write) mapping."""

    def __init__(self, ident: int, size: int) -> None:
        self.ident = ident
        self.size = size
        self.capacity = paged(size)
        """Bytes the memfd holds: ``size`` in whole pages (a reused segment may be larger)."""
        try:
            self.fd = os.memfd_create(f"checkpointd-{ident}", os.MFD_CLOEXEC)
        except OSError as exc:
            raise ServiceError(f"cannot create a shared-memory segment: {exc}") from exc
        try:
            os.ftruncate(self.fd, self.capacity)
            self.map = _populated(self.fd, self.capacity)
        except BaseException:
            os.close(self.fd)
            raise

    def reuse(self, ident: int, size: int) -> MappedSegment:
        """This segment's memory (already faulted in) as segment ``ident`` of ``size``
        bytes (at most its capacity). The old contents stay until overwritten."""
        assert size <= self.capacity
        self.ident, self.size = ident, size
        return self

    def view(self) -> memoryview:
        """The segment's bytes (valid while the segment is open)."""
        return memoryview(self.map)[: self.size]

    def close(self) -> None:
        """Close the fd and unmap; a mapping still exported (a view alive) is left to
        the garbage collector. Idempotent."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(BufferError):  # views of it still alive: unmapped when
            self.map.close()  # they go


def _populated(fd: int, size: int) -> mmap.mmap:
    """A read-write mapping of the whole memfd with every page allocated, asked to be
    huge pages first (``tunables.SHM_HUGE_PAGES``): the advice must precede the first
    touch, so the pages are populated by ``MADV_POPULATE_WRITE`` rather than at mmap
    time; before Linux 5.14 the segment is mapped again with ``MAP_POPULATE``."""
    mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    try:
        if tunables.SHM_HUGE_PAGES and hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):
                mapped.madvise(mmap.MADV_HUGEPAGE)
        mapped.madvise(MADV_POPULATE_WRITE)
    except OSError:
        mapped.close()
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except BaseException:
        mapped.close()
        raise
    return mapped


def reusable(capacity: int, nbytes: int) -> bool:
    """Whether a segment of ``capacity`` bytes serves a save of ``nbytes``: large enough,
    and at most twice as large (the service's rule for reusing a spare, which a client
    asking for a segment ahead of its capture applies too)."""
    return nbytes <= capacity <= max(2 * nbytes, paged(nbytes))


def paged(nbytes: int) -> int:
    """``nbytes`` (at least one) rounded up to whole pages: what a segment of that size
    costs, and counts against ``--memory-limit``."""
    return -(-max(nbytes, 1) // mmap.PAGESIZE) * mmap.PAGESIZE


def huge_pages_mode() -> str:
    """The kernel's setting for shared-memory huge pages (``advise``, ``never``...), or
    ``unknown`` where it cannot be read: logged by ``checkpointd serve`` at start."""
    try:
        with open(_SHMEM_ENABLED, encoding="ascii") as file:
            words = file.read().split()
    except OSError:
        return "unknown"
    chosen = [w[1:-1] for w in words if w.startswith("[") and w.endswith("]")]
    return chosen[0] if chosen else "unknown"


def readonly_fd(fd: int) -> int:
    """A new fd for the same memfd, opened read-only (Linux: through /proc/self/fd)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


def map_fd(fd: int, size: int, *, writable: bool, populate: bool = True) -> mmap.mmap:
    """Map a received segment fd (then closed); ServiceError if it is not ``size`` bytes.

    ``populate``: set up every page at once (MAP_POPULATE), for a segment written
    page by page; a segment read once in order is faster faulted in as it is read
    (the kernel maps the pages around each fault)."""
    try:
        actual = os.fstat(fd).st_size
        if actual < max(size, 1):
            raise ServiceError(f"a segment of {actual} bytes came where {size} were announced")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        return mmap.mmap(fd, max(size, 1), flags=flags, prot=prot)
    finally:
        os.close(fd)
