"""One client connection as the service sees it: its stream, what it owns, what it borrows.

``owned``: segments allocated and not yet submitted (freed when the connection
ends: a trainer killed while copying); ``borrowed``: held segments lent to it for
a restore (given back when it ends); ``tasks``: its requests that wait for memory,
so that its later frames (a ``Free``) are still read meanwhile. On the service's
event loop. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
from anyio.abc import SocketStream, TaskGroup

from checkpointd.daemon.wire import protocol as p
from checkpointd.daemon.wire.shm import MappedSegment

__all__ = ["Conn"]


@dataclass(eq=False)  # one connection is equal to itself only (kept in sets)
class Conn:
    stream: SocketStream
    pid: int = 0
    """The client process (SO_PEERCRED) at connection time."""
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    open: bool = True
    owned: dict[int, MappedSegment] = field(default_factory=dict)
    borrowed: list[MappedSegment] = field(default_factory=list)
    tasks: TaskGroup | None = None
    """Its requests that may wait (``Alloc``), cancelled when the connection ends."""
    asking: int = 0
    """Its ``Alloc`` requests not answered yet (admission.py counts them as its segments)."""

    async def send(self, message: p.Message, fds: list[int] | None = None) -> None:
        """Send one frame (and ``fds``); a client gone is marked closed, never raised."""
        if not self.open:
            return
        frame = p.encode(message)
        async with self.lock:
            try:
                if fds:
                    await self.stream.send_fds(frame, fds)  # type: ignore[attr-defined]
                else:
                    await self.stream.send(frame)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                self.open = False
