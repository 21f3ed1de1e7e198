"""The service's CPU and I/O priority: below the trainer's by default.

The service shares the node's cores and disks with the training processes it
serves; a save should take what training leaves. ``lower_priority`` raises the
niceness and sets the I/O priority (Linux ``ioprio_set``: best effort at the given
level, or the idle class) of every thread the process has, where the kernel allows
it. On Linux both are per thread, and a thread inherits them from the one that
starts it: so the threads started later get them too, and the ones already there
must be set one by one (importing numpy starts OpenBLAS's worker thread, which kept
niceness 0 and no I/O class while only the calling thread was lowered). Either may
be refused (a container without the right, another kernel): it is logged, never
fatal. ``lowest`` runs background work (a replica's pages and bytes) on a thread of its
own at the lowest CPU priority, below the service's saves. No torch here.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import platform
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["io_priority", "lower_priority", "lowest"]

_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "arm64": 30}
_IOPRIO_GET = {"x86_64": 252, "aarch64": 31, "arm64": 31}
_WHO_PROCESS = 1
_CLASS_BEST_EFFORT, _CLASS_IDLE = 2, 3
_CLASS_SHIFT = 13
LOWEST_NICENESS = 19
_T = TypeVar("_T")

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


def _thread_ids() -> list[int]:
    """Every thread of this process (Linux: /proc/self/task), or 0 (the calling one)."""
    try:
        return sorted(int(tid) for tid in os.listdir("/proc/self/task"))
    except OSError:
        return [0]


def lower_priority(niceness: int, io: str) -> None:
    """Add ``niceness`` to every thread's of this process (0: unchanged; at most 19) and
    set their I/O priority: ``io`` is a best-effort level "0".."7", "idle", or "none"
    (unchanged). Call it from the main thread before the service starts its own."""
    threads = _thread_ids()
    if niceness:
        try:
            for tid in threads:
                with contextlib.suppress(ProcessLookupError):  # the thread has ended
                    now = os.getpriority(os.PRIO_PROCESS, tid)
                    os.setpriority(os.PRIO_PROCESS, tid, min(19, now + niceness))
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
        for tid in threads:
            try:
                _syscall(_IOPRIO_SET, _WHO_PROCESS, tid, value)
            except OSError as exc:
                if exc.errno != errno.ESRCH:  # ESRCH: the thread has ended
                    raise
    except OSError as exc:
        _log.warning("could not lower the service's I/O priority: %s", exc)


def lowest(func: Callable[..., _T], *args: object) -> _T:
    """``func(*args)`` on a new thread at the lowest CPU priority (background work: a
    replica's bytes and their pages); its result, or its exception raised here. A
    thread of its own because a thread's niceness can be raised but not lowered back
    without privileges: the service's worker threads are never the ones lowered.
    Blocking (call it through ``anyio.to_thread``)."""
    outcome: list[tuple[bool, object]] = []

    def body() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_NICENESS)
        except OSError as exc:  # not Linux, or refused: the transfer goes on regardless
            _log.debug("a background thread keeps its priority: %s", exc)
        try:
            outcome.append((True, func(*args)))
        except BaseException as exc:  # handed to the caller, raised there
            outcome.append((False, exc))

    thread = threading.Thread(target=body, name="checkpointd-background", daemon=True)
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        assert isinstance(value, BaseException)
        raise value
    return value  # type: ignore[return-value]
