"""Host memory for loaded tensors, faulted in bulk and on both cores.

A fresh allocation of a few hundred MB costs more in first-touch page faults than
reading a file into it from the page cache (measured on the 2-vCPU VM of the
README: ~0.22 s to fault in 705 MB, ~0.04 s to copy it from the page cache). A
loaded file gets one allocation (``host_buffer``), and the reader faults each
chunk of fresh memory in just before reading into it, from as many threads as it reads with:
``prefault`` asks the kernel to populate the range writable in one call
(``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+, through ctypes so the GIL is
released), which measured ~20% faster than taking the faults one page at a time
inside ``read``. Transparent huge pages (``MADV_HUGEPAGE``) were tried and are not
used: with the common ``defrag=madvise`` setting each fault may compact memory
synchronously, and 705 MB then took 0.6-1.6 s instead of 0.03 s. Where the call is
missing or refused (another OS, an older kernel) ``prefault`` is a no-op and the
reads fault the pages in.

Memory kept for reuse: a file of at least ``tunables.KEEP_MIN_BYTES`` whose tensors are
handed to the caller (``load``; not a restore's temporaries) is loaded into an
anonymous map of its own (what glibc would give ``torch.empty`` for it anyway), and when
the last tensor over it is freed the map is kept for ``tunables.KEEP_SECONDS`` instead
of being unmapped, so that the next load of a same-sized file (an eval loop, a retry)
reads into pages already faulted in and skips the prefault. torch.load only gets this
when glibc's heap happens not to be trimmed. A load that finds no kept map that fits
lets every kept map go before it allocates, so peak RSS never exceeds what it was
without keeping. Any thread.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import mmap
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from checkpointd import tunables
from checkpointd.format.checksum import crc32c, crc32c_combine

if TYPE_CHECKING:
    import torch

    from checkpointd.storage.base import PinnedFile

__all__ = ["MADV_POPULATE_WRITE", "host_buffer", "prefault", "read_checked"]

MADV_POPULATE_WRITE = 23
"""``madvise`` advice (linux/mman.h, Linux 5.14+; not in Python's ``mmap`` before 3.13):
populate a range writable, every page allocated."""
_PAGE = mmap.PAGESIZE
_madvise: Any = None
_works = sys.platform.startswith("linux")


def _libc_madvise() -> Any:
    global _madvise, _works
    if _madvise is None:
        try:
            function = ctypes.CDLL(None, use_errno=True).madvise
        except (OSError, AttributeError):
            _works = False
            return None
        function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        function.restype = ctypes.c_int
        _madvise = function
    return _madvise


def prefault(address: int, length: int) -> None:
    """Fault the pages of ``[address, address + length)`` in, writable, in one kernel call
    (the range is widened to whole pages; the contents are not changed). A no-op where
    the kernel cannot; the first refusal turns it off for the process."""
    global _works
    if not _works or length <= 0:
        return
    function = _libc_madvise()
    if function is None:
        return
    start = address - address % _PAGE
    if function(start, length + (address - start), MADV_POPULATE_WRITE) != 0:
        _works = False  # EINVAL before Linux 5.14 (or not Linux): let the reads fault


_kept_lock = threading.Lock()
_kept: list[tuple[float, mmap.mmap]] = []  # (when freed, map), oldest first
_expiry: tuple[float, threading.Timer] | None = None  # (when it fires, the timer)


def _arm(now: float) -> None:
    """Have ``_expire`` run when the oldest kept map is due (``_kept_lock`` held)."""
    global _expiry
    due = _kept[0][0] + tunables.KEEP_SECONDS
    if _expiry is not None and _expiry[0] <= due:
        return
    if _expiry is not None:
        _expiry[1].cancel()
    timer = threading.Timer(max(due - now, 0.0), _expire)
    timer.daemon = True  # never holds the interpreter's exit
    timer.start()
    _expiry = (due, timer)


def _keep(block: mmap.mmap) -> None:
    """Keep a map whose last tensor was just freed (a finalizer: the freeing thread)."""
    with _kept_lock:
        now = time.monotonic()
        _kept.append((now, block))
        _arm(now)


def _expire() -> None:
    """Let the maps kept ``tunables.KEEP_SECONDS`` or longer go (the timer's thread)."""
    global _expiry
    with _kept_lock:
        now = time.monotonic()
        due = [freed + tunables.KEEP_SECONDS <= now for freed, _ in _kept]
        gone = [block for (_, block), old in zip(_kept, due, strict=True) if old]
        _kept[:] = [kept for kept, old in zip(_kept, due, strict=True) if not old]
        _expiry = None
        if _kept:
            _arm(now)
    del gone  # unmapped here, outside the lock


def _take(size: int) -> mmap.mmap | None:
    """The smallest kept map of ``size`` to ``size * 9 / 8`` bytes, or None after letting
    every kept map go (so that the allocation that follows adds to no kept memory)."""
    with _kept_lock:
        fits = [i for i, (_, block) in enumerate(_kept) if size <= len(block) <= size + size // 8]
        if not fits:
            gone = [block for _, block in _kept]
            _kept.clear()
            found = None
        else:
            gone = []
            found = _kept.pop(min(fits, key=lambda i: len(_kept[i][1])))[1]
    del gone
    return found


def host_buffer(size: int, *, keep: bool) -> tuple[torch.Tensor, bool]:
    """A uint8 CPU tensor of ``size`` bytes for a file to be read into, and whether its
    memory is fresh (to be prefaulted) rather than a kept map already faulted in. With
    ``keep`` (tensors handed to a caller, who frees them later) its memory is kept once
    freed; without (a restore's temporary) it is unmapped. Any thread."""
    import numpy
    import torch

    block = _take(size) if size >= tunables.KEEP_MIN_BYTES else None
    fresh = block is None
    if block is None:
        if not keep or size < tunables.KEEP_MIN_BYTES:
            return torch.empty(size, dtype=torch.uint8), True
        # Private: mmap's default (MAP_SHARED) is shmem, slower to fault, shared across fork.
        block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    array = numpy.frombuffer(block, dtype=numpy.uint8, count=size)
    if keep:  # the tensor holds the array; when its last view is freed the map is kept
        weakref.finalize(array, _keep, block).atexit = False
    return torch.from_numpy(array), fresh


def read_checked(pinned: PinnedFile, data: torch.Tensor, *, fresh: bool = True) -> int:
    """Fill ``data`` from ``pinned`` in chunks, each faulted in first when ``data`` is
    ``fresh`` memory, read and checksummed by one of ``tunables.FILE_READ_THREADS``
    threads (all three release the GIL); the CRC32C of the whole, combined from the
    chunks' in order."""
    chunk = tunables.READ_CHUNK_BYTES
    view = data.numpy().data.cast("B")
    base = data.data_ptr()

    def work(at: int) -> int:
        part = view[at : at + chunk]
        if fresh:
            prefault(base + at, len(part))
        pinned.read_into(part, at)
        return crc32c(part)

    offsets = range(0, len(view), chunk)
    with concurrent.futures.ThreadPoolExecutor(tunables.FILE_READ_THREADS) as pool:
        digests = list(pool.map(work, offsets))
    digest = 0
    for at, part in zip(offsets, digests, strict=True):
        digest = crc32c_combine(digest, part, min(chunk, len(view) - at))
    return digest
