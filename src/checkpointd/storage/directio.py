"""Direct I/O for large aligned writes: bytes go from the staging buffer to the disk.

A buffered write first copies every byte into the page cache, and fsync then
writes the dirty pages out; on the benchmark machine that copy costs as much
as the disk itself (see README, Performance). With ``O_DIRECT`` the kernel
DMAs straight from our buffer, so a large tensor file reaches the disk in
about the time of the fsync alone. It needs the buffer address, the file
position and the length aligned to the device's block size; anything else
(and any file system that refuses ``O_DIRECT``) takes the buffered path. The
caller still fsyncs: ``O_DIRECT`` alone does not flush the device cache or
the file's metadata.
"""

from __future__ import annotations

import errno
import fcntl
import os

import numpy as np

from checkpointd import tunables
from checkpointd.format.layout import DIRECT_ALIGN

__all__ = ["DIRECT_ALIGN", "write_direct"]

_O_DIRECT: int = getattr(os, "O_DIRECT", 0)


def address(view: memoryview) -> int:
    """The address of the first byte of ``view`` (works for read-only buffers too)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def write_direct(fd: int, view: memoryview) -> tuple[memoryview, bool]:
    """Write the aligned prefix of ``view`` at ``fd``'s position with O_DIRECT.

    Returns the bytes not written (for the caller's buffered path) and whether
    direct I/O is still worth trying on this file (False once the file system
    refused it). Raises OSError for real write errors, after restoring the flags.
    """
    aligned = len(view) - len(view) % DIRECT_ALIGN
    if (
        not _O_DIRECT
        or aligned < tunables.DIRECT_MIN_BYTES
        or address(view) % DIRECT_ALIGN
        or os.lseek(fd, 0, os.SEEK_CUR) % DIRECT_ALIGN
    ):
        return view, True
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return view, False
        raise
    done = 0
    try:
        while done < aligned:
            try:
                written = os.write(fd, view[done:aligned])
            except OSError as exc:
                if exc.errno == errno.EINVAL and done % DIRECT_ALIGN == 0:
                    # The device wants a larger alignment than ours: go buffered.
                    return view[done:], False
                raise
            done += written
            if written % DIRECT_ALIGN:
                break  # a short, unaligned write: finish the rest buffered
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    return view[done:], True
