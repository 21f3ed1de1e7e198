"""Host memory for loaded tensors, faulted in bulk and on both cores.

A fresh allocation of a few hundred MB costs more in first-touch page faults than
reading a file into it from the page cache (measured on the 2-vCPU VM of the
README: ~0.22 s to fault in 705 MB, ~0.04 s to copy it from the page cache). A
loaded file gets one allocation (``torch.empty``), and the reader faults each
chunk in just before reading into it, from as many threads as it reads with:
``prefault`` asks the kernel to populate the range writable in one call
(``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+, through ctypes so the GIL is
released), which measured ~20% faster than taking the faults one page at a time
inside ``read``. Transparent huge pages (``MADV_HUGEPAGE``) were tried and are not
used: with the common ``defrag=madvise`` setting each fault may compact memory
synchronously, and 705 MB then took 0.6-1.6 s instead of 0.03 s. Where the call is
missing or refused (another OS, an older kernel) ``prefault`` is a no-op and the
reads fault the pages in. Any thread.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import mmap
import sys
from typing import TYPE_CHECKING, Any

from checkpointd import tunables
from checkpointd.format.checksum import crc32c, crc32c_combine

if TYPE_CHECKING:
    import torch

    from checkpointd.storage.base import PinnedFile

__all__ = ["MADV_POPULATE_WRITE", "prefault", "read_checked"]

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


def read_checked(pinned: PinnedFile, data: torch.Tensor) -> int:
    """Fill ``data`` (fresh memory) from ``pinned`` in chunks, each faulted in, read and
    checksummed by one of ``tunables.FILE_READ_THREADS`` threads (all three release the
    GIL); the CRC32C of the whole, combined from the chunks' in order."""
    chunk = tunables.READ_CHUNK_BYTES
    view = data.numpy().data.cast("B")
    base = data.data_ptr()

    def work(at: int) -> int:
        part = view[at : at + chunk]
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
