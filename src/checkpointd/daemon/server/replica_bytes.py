"""A replica's bytes on a peer connection: moved between a segment and the socket by a
thread of the lowest CPU priority, and checked against their CRC32Cs on arrival.

A replica is background work: its copies (the kernel's, into and out of the socket) and
its checksum run on a thread of their own at niceness 19, so that a node's saves and
training take the cores first (a thread's niceness can be raised but not lowered back
without privileges, so the service's worker threads are never the ones lowered). The
receiving side checks every held file's bytes (``HeldFile.crc32c``, as the sending
service committed them) before it holds the replica: one that does not match is never
held. No torch here.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from anyio.abc import ByteStream, SocketAttribute

from checkpointd import tunables
from checkpointd.daemon.wire import protocol as p
from checkpointd.daemon.wire.shm import MappedSegment
from checkpointd.format.checksum import crc32c

__all__ = ["deadline", "lowest", "mismatched", "move"]

_log = logging.getLogger(__name__)

_T = TypeVar("_T")

LOWEST_NICENESS = 19


def deadline(size: int) -> float:
    """Seconds a replica of ``size`` bytes may take on the wire."""
    return tunables.FRAME_SECONDS + size / tunables.PEER_MIN_BYTES_PER_SECOND


def lowest(func: Callable[..., _T], *args: object) -> _T:
    """``func(*args)`` on a new thread at the lowest CPU priority; its result, or its
    exception raised here. Blocking (call it through ``anyio.to_thread``)."""
    outcome: list[tuple[bool, object]] = []

    def body() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_NICENESS)
        except OSError as exc:  # not Linux, or refused: the transfer goes on regardless
            _log.debug("a replica's thread keeps its priority: %s", exc)
        try:
            outcome.append((True, func(*args)))
        except BaseException as exc:  # handed to the caller, raised there
            outcome.append((False, exc))

    thread = threading.Thread(target=body, name="checkpointd-replica", daemon=True)
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        assert isinstance(value, BaseException)
        raise value
    return value  # type: ignore[return-value]


def move(stream: ByteStream, segment: MappedSegment, until: float, sending: bool) -> None:
    """Send ``segment``'s bytes on ``stream``'s socket, or receive that many into it, by
    ``until`` (time.monotonic; TimeoutError after it); ProtocolError if the other side
    closes first. A thread of its own, while the event loop leaves the socket alone."""
    wrapped = stream.extra(SocketAttribute.raw_socket)  # asyncio's: no recv_into
    # a socket object of our own on a duplicate of its fd (the same connection, still
    # non-blocking: its mode is the connection's, left as it is)
    sock = socket.fromfd(wrapped.fileno(), wrapped.family, wrapped.type)
    size, chunk = segment.size, tunables.PEER_CHUNK_BYTES
    poll = select.poll()
    poll.register(sock, select.POLLOUT if sending else select.POLLIN)
    done = 0
    with sock, memoryview(segment.map) as view:
        while done < size:
            left = until - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"a replica's {size} bytes did not pass within the time allowed")
            if not poll.poll(left * 1000):
                continue
            part = view[done : min(size, done + chunk)]
            try:
                moved = sock.send(part) if sending else sock.recv_into(part)
            except (BlockingIOError, InterruptedError):
                continue
            if moved == 0:
                raise p.ProtocolError("the peer closed the connection inside a replica's bytes")
            done += moved


def mismatched(segment: MappedSegment, files: list[p.HeldFile]) -> str | None:
    """The path of the first of ``files`` whose bytes in ``segment`` (after its head) do
    not have its CRC32C, or None if every one does. Blocking."""
    with memoryview(segment.map) as view:
        for file in files:
            value = crc32c(file.head)
            value = crc32c(view[file.offset : file.offset + file.length], value)
            if value != file.crc32c:
                return file.path
    return None
