"""Frames of the service's protocol on a socket: sending one (with file descriptors
beside it, as SCM_RIGHTS, only from the service to a client), reading them from a
blocking socket (the client's side) or an anyio stream (the service's side, where a
frame's body must follow its length within ``FRAME_SECONDS``). No torch here.
"""

from __future__ import annotations

import contextlib
import os
import socket

import anyio
from anyio.abc import ByteReceiveStream

from .protocol import MAX_FRAME, PREFIX, Message, ProtocolError, decode, encode

__all__ = ["FRAME_SECONDS", "FrameReader", "body_length", "os_close", "read_async", "send_frame"]

FRAME_SECONDS = 30.0
"""How long the rest of a frame may take once its length arrived (service side)."""


def body_length(prefix: bytes) -> int:
    """The body length a 4-byte prefix announces; ProtocolError over MAX_FRAME."""
    (length,) = PREFIX.unpack(prefix)
    if length > MAX_FRAME:
        raise ProtocolError(f"a frame of {length} bytes announced; the limit is {MAX_FRAME}")
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
            data, fds, _flags, _addr = socket.recv_fds(self.sock, 1 << 20, 8)
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


async def read_async(stream: ByteReceiveStream, buffer: bytearray) -> Message | None:
    """The next frame's message from an anyio stream (the service's side), None at a
    clean end; ProtocolError otherwise (a frame's body must arrive within
    FRAME_SECONDS of its length)."""

    async def fill(count: int) -> bool:
        while len(buffer) < count:
            try:
                buffer.extend(await stream.receive(1 << 20))
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return False
        return True

    if not await fill(4):
        if buffer:
            raise ProtocolError("the stream ended inside a frame's length prefix")
        return None
    length = body_length(bytes(buffer[:4]))
    with anyio.move_on_after(FRAME_SECONDS) as scope:
        complete = await fill(4 + length)
    if scope.cancelled_caught:
        raise ProtocolError(f"a frame's body did not arrive within {FRAME_SECONDS}s")
    if not complete:
        raise ProtocolError("the stream ended inside a frame")
    body = bytes(buffer[4 : 4 + length])
    del buffer[: 4 + length]
    return decode(body)
