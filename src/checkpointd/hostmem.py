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

import ctypes
import mmap
import sys
from typing import Any

__all__ = ["prefault"]

_MADV_POPULATE_WRITE = 23  # linux/mman.h
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
    if function(start, length + (address - start), _MADV_POPULATE_WRITE) != 0:
        _works = False  # EINVAL before Linux 5.14 (or not Linux): let the reads fault
