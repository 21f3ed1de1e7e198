"""The service's CPU and I/O priority: below the trainer's by default.

The service shares the node's cores and disks with the training processes it
serves; a save should take what training leaves. ``lower_priority`` raises the
process's niceness (``os.nice``: every thread, also those started later) and
sets its I/O priority (Linux ``ioprio_set``: best effort at the given level, or
the idle class) where the kernel allows it. Either may be refused (a container
without the right, another kernel): it is logged, never fatal. No torch here.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

__all__ = ["io_priority", "lower_priority"]

_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "arm64": 30}
_IOPRIO_GET = {"x86_64": 252, "aarch64": 31, "arm64": 31}
_WHO_PROCESS = 1
_CLASS_BEST_EFFORT, _CLASS_IDLE = 2, 3
_CLASS_SHIFT = 13

_log = logging.getLogger(__name__)


def _syscall(numbers: dict[str, int], *args: int) -> int:
    number = numbers.get(platform.machine())
    if number is None:
        raise OSError(f"ioprio is not known on {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    result = int(libc.syscall(number, *args))
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return result


def io_priority(pid: int = 0) -> tuple[int, int]:
    """(class, level) of process ``pid``'s I/O priority (0: this one; class 0: none set,
    it follows the niceness)."""
    value = _syscall(_IOPRIO_GET, _WHO_PROCESS, pid)
    return value >> _CLASS_SHIFT, value & ((1 << _CLASS_SHIFT) - 1)


def lower_priority(niceness: int, io: str) -> None:
    """Add ``niceness`` to this process's (0: unchanged) and set its I/O priority: ``io``
    is a best-effort level "0".."7", "idle", or "none" (unchanged)."""
    if niceness:
        try:
            os.nice(niceness)
        except OSError as exc:
            _log.warning("could not lower the service's CPU priority: %s", exc)
    if io == "none":
        return
    value = (
        _CLASS_IDLE << _CLASS_SHIFT
        if io == "idle"
        else (_CLASS_BEST_EFFORT << _CLASS_SHIFT) | int(io)
    )
    try:
        _syscall(_IOPRIO_SET, _WHO_PROCESS, 0, value)
    except OSError as exc:
        _log.warning("could not lower the service's I/O priority: %s", exc)
