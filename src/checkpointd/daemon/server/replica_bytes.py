"""A replica's bytes on a peer connection: moved between a segment and the socket, and
checked against their CRC32Cs on arrival.

A replica is background work: peerlink.py runs these on a thread of the lowest CPU
priority (``priority.lowest``), so that a node's saves and training take the cores
first. The receiving side checks every held file's bytes (``HeldFile.crc32c``, as the
sending service committed them) before it holds the replica: one that does not match
is never held. No torch here.
"""

from __future__ import annotations

import select
import socket
import time

from anyio.abc import ByteStream, SocketAttribute

from checkpointd import tunables
from checkpointd.daemon.wire import protocol as p
from checkpointd.daemon.wire.shm import MappedSegment
from checkpointd.format.checksum import crc32c

__all__ = ["deadline", "mismatched", "move"]


def deadline(size: int) -> float:
    """Seconds a replica of ``size`` bytes may take on the wire."""
    return tunables.FRAME_SECONDS + size / tunables.PEER_MIN_BYTES_PER_SECOND


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
