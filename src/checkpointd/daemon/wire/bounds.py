"""What one frame may cost the service, decided before msgspec builds anything.

A request other than ``Submit`` (the one kind that carries a snapshot's
description) may be at most ``tunables.MAX_REQUEST_BYTES``; ``request_limit``
tells from a body's first bytes. ``check_structure`` walks a body's msgpack
structure without making objects and refuses one nested deeper than
``tunables.MAX_FRAME_DEPTH`` or holding more than ``tunables.MAX_FRAME_ITEMS``
objects: decoding is then bounded in time and memory (msgspec holds the GIL while
it decodes, so an unbounded one stalls every client and the heartbeats).
``FrameBudget`` bounds the bytes of frames being received over all connections.
No torch here.
"""

from __future__ import annotations

from datetime import datetime

import anyio
import msgspec

from checkpointd import tunables
from checkpointd.daemon.wire import protocol as p

__all__ = ["FrameBudget", "check_structure", "request_limit"]


def _submit_head() -> bytes:
    """The first bytes of every ``Submit`` body (msgspec writes the tag first)."""
    stamp = datetime(2000, 1, 1)
    empty = p.SnapshotDesc(step=0, created_at=stamp, components=[], metrics={}, metadata={})
    body = msgspec.msgpack.encode(p.Submit(0, writer=0, segment=0, snapshot=empty))
    return body[: 1 + len(msgspec.msgpack.encode("kind")) + len(msgspec.msgpack.encode("Submit"))]


SUBMIT_HEAD = _submit_head()
"""A body that starts with these bytes is a ``Submit``'s (or garbage that fails to decode)."""


def request_limit(head: bytes) -> int:
    """The largest body a frame starting with ``head`` (at least ``len(SUBMIT_HEAD)``
    bytes, or the whole body) may have."""
    if head.startswith(SUBMIT_HEAD):
        return tunables.MAX_FRAME_BYTES
    return tunables.MAX_REQUEST_BYTES


def _kinds() -> tuple[tuple[int, int, int], ...]:
    """Per msgpack first byte: (kind, length bytes that follow, fixed size). kind 0: a
    scalar of ``size`` payload bytes (plus the length's), 1: an array, 2: a map (of
    ``size`` entries, plus the length's), -1: a byte msgpack never uses."""
    table = []
    sized = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}  # bin, str
    ext = {0xC7: 1, 0xC8: 2, 0xC9: 4}  # ext: its length, then a type byte
    fixed = {0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}
    fixed |= {0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}
    fixed |= {0xD4 + i: 1 + (1 << i) for i in range(5)}  # fixext: type byte and data
    for b in range(256):
        if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):
            table.append((0, 0, 0))
        elif b <= 0x8F:
            table.append((2, 0, b & 0x0F))
        elif b <= 0x9F:
            table.append((1, 0, b & 0x0F))
        elif b <= 0xBF:
            table.append((0, 0, b & 0x1F))
        elif b in sized:
            table.append((0, sized[b], 0))
        elif b in ext:
            table.append((0, ext[b], 1))
        elif b in fixed:
            table.append((0, 0, fixed[b]))
        elif b in (0xDC, 0xDD):
            table.append((1, 2 if b == 0xDC else 4, 0))
        elif b in (0xDE, 0xDF):
            table.append((2, 2 if b == 0xDE else 4, 0))
        else:
            table.append((-1, 0, 0))
    return tuple(table)


_KINDS = _kinds()


def check_structure(body: bytes | memoryview | bytearray) -> None:
    """ProtocolError if ``body``'s msgpack nests deeper than MAX_FRAME_DEPTH or holds
    more than MAX_FRAME_ITEMS objects (a container's announced length counts in full,
    before its elements are seen). Malformed bytes are left to the decoder. Any thread."""
    max_items, max_depth = tunables.MAX_FRAME_ITEMS, tunables.MAX_FRAME_DEPTH
    kinds = _KINDS
    view = memoryview(body).cast("B") if not isinstance(body, bytes) else body
    end = len(view)
    at, items, left = 0, 1, 1  # left: objects still to come in the open container
    stack: list[int] = []
    while at < end:
        kind, head, size = kinds[view[at]]
        at += 1
        if head:
            size += int.from_bytes(view[at : at + head], "big")
            at += head
        if kind == 0:
            at += size
        elif kind < 0:
            return  # not msgpack: the decoder says so
        elif size:
            items += size * kind
            if items > max_items:
                raise p.ProtocolError(f"a frame of more than {max_items} objects")
            stack.append(left - 1)
            if len(stack) > max_depth:
                raise p.ProtocolError(f"a frame nested deeper than {max_depth}")
            left = size * kind
            continue
        left -= 1
        while left == 0 and stack:
            left = stack.pop()
        if left == 0:
            return


class FrameBudget:
    """Bytes of frame bodies being received, over every connection, within ``limit``.
    On the service's event loop."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._freed = anyio.Event()
        self.decoding = anyio.Lock()
        """Held while a large frame is checked and decoded (on a worker thread)."""

    async def reserve(self, nbytes: int) -> None:
        """Take ``nbytes`` (waits while they would pass the limit; a frame alone may
        take it all)."""
        while self.used and self.used + nbytes > self.limit:
            await self._freed.wait()
        self.used += nbytes

    def release(self, nbytes: int) -> None:
        """Give back what ``reserve`` took."""
        self.used -= nbytes
        self._freed.set()
        self._freed = anyio.Event()
