"""Frames of the service's protocol on a socket: sending one (with file descriptors
beside it, as SCM_RIGHTS, only from the service to a client), reading them from a
blocking socket (the client's side) or an anyio stream (the service's side, where a
frame's body must follow its length within ``tunables.FRAME_SECONDS``, and what it may
cost is bounded by bounds.py). No torch here.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
from anyio.abc import ByteReceiveStream

from checkpointd import tunables
from checkpointd.daemon.wire.bounds import SUBMIT_HEAD, FrameBudget, check_structure, request_limit
from checkpointd.daemon.wire.protocol import PREFIX, Message, ProtocolError, decode, encode

__all__ = ["FrameReader", "body_length", "os_close", "read_async", "send_frame"]


def body_length(prefix: bytes) -> int:
    """The body length a 4-byte prefix announces; ProtocolError over
    ``tunables.MAX_FRAME_BYTES``."""
    (length,) = PREFIX.unpack(prefix)
    if length > (limit := tunables.MAX_FRAME_BYTES):
        raise ProtocolError(f"a frame of {length} bytes announced; the limit is {limit}")
    return int(length)


def send_frame(sock: socket.socket, message: Message, fds: list[int] | None = None) -> None:
    """Send one frame on a blocking socket, with ``fds`` (SCM_RIGHTS) if any."""
    frame = encode(message)
    if fds:
        sent = socket.send_fds(sock, [frame], fds)
        frame = frame[sent:]
    if frame:
        sock.sendall(frame)


class FrameReader:
    """Reads frames from a blocking socket, collecting the fds that arrive beside them."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.fds: list[int] = []
        self._buffer = bytearray()

    def _fill(self, count: int) -> bool:
        while len(self._buffer) < count:
            data, fds, _flags, _addr = socket.recv_fds(self.sock, tunables.FRAME_RECEIVE_BYTES, 8)
            self.fds.extend(fds)
            if not data:
                return False
            self._buffer += data
        return True

    def read(self) -> Message | None:
        """The next message, or None at a clean end of the stream; ProtocolError on a
        bad frame or a stream cut in the middle of one."""
        if not self._fill(4):
            if self._buffer:
                raise ProtocolError("the stream ended inside a frame's length prefix")
            return None
        length = body_length(bytes(self._buffer[:4]))
        if not self._fill(4 + length):
            raise ProtocolError("the stream ended inside a frame")
        body = bytes(self._buffer[4 : 4 + length])
        del self._buffer[: 4 + length]
        return decode(body)

    def take_fd(self) -> int:
        """The oldest fd received and not yet taken; ProtocolError if none came."""
        if not self.fds:
            raise ProtocolError("a message that carries a file descriptor came without one")
        return self.fds.pop(0)

    def close(self) -> None:
        """Close the fds received and never taken."""
        for fd in self.fds:
            os_close(fd)
        self.fds.clear()


def os_close(fd: int) -> None:
    """Close ``fd``, ignoring an error (it may be closed already)."""
    with contextlib.suppress(OSError):
        os.close(fd)


async def read_async(
    stream: ByteReceiveStream,
    buffer: bytearray,
    budget: FrameBudget,
    *,
    decoder: Callable[[memoryview], Any] = decode,
    limit: Callable[[bytes], int] = request_limit,
) -> Any:
    """The next frame's message from an anyio stream (the service's side), None at a
    clean end; ProtocolError otherwise: a frame over its kind's limit
    (``bounds.request_limit``, told from its first bytes), one whose body does not arrive
    within FRAME_SECONDS of its length, one past ``bounds.check_structure``. A frame over
    SMALL_FRAME_BYTES holds its length of ``budget`` while it is buffered and is checked
    and decoded on a worker thread, one at a time. ``decoder`` and ``limit``: another
    protocol's (the peer port's, wire/peers.py). Event loop."""

    async def fill(count: int) -> bool:
        while len(buffer) < count:
            most, least = tunables.FRAME_RECEIVE_BYTES, tunables.FRAME_RECEIVE_MIN_BYTES
            want = min(most, max(count - len(buffer), least))  # little past this frame
            try:
                buffer.extend(await stream.receive(want))
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return False
        return True

    if not await fill(4):
        if buffer:
            raise ProtocolError("the stream ended inside a frame's length prefix")
        return None
    length = body_length(bytes(buffer[:4]))
    large = length > tunables.SMALL_FRAME_BYTES
    reserved = 0
    try:
        with anyio.move_on_after(tunables.FRAME_SECONDS) as scope:
            complete = await fill(4 + min(length, len(SUBMIT_HEAD)))
            most = limit(bytes(buffer[4 : 4 + len(SUBMIT_HEAD)]))
            if complete and length > most:
                raise ProtocolError(
                    f"a frame of {length} bytes announced; the limit is {most} for any "
                    "request but a Submit"
                )
            if complete and large:
                await budget.reserve(length)
                reserved = length
            complete = complete and await fill(4 + length)
        if scope.cancelled_caught:
            raise ProtocolError(f"a frame's body did not arrive within {tunables.FRAME_SECONDS}s")
        if not complete:
            raise ProtocolError("the stream ended inside a frame")
        if large:
            async with budget.decoding:
                message = await anyio.to_thread.run_sync(_take, buffer, length, decoder)
        else:
            message = _take(buffer, length, decoder)
    finally:
        if reserved:
            budget.release(reserved)
    del buffer[: 4 + length]
    return message


def _take(buffer: bytearray, length: int, decoder: Callable[[memoryview], Any]) -> Any:
    """The message of the frame at the start of ``buffer`` (``length`` bytes after its
    prefix), its structure bounded first. Any thread."""
    with memoryview(buffer) as view, view[4 : 4 + length] as body:
        check_structure(body)
        return decoder(body)
