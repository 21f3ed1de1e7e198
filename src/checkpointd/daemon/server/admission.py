"""Which connections and segments the service takes on, and accepting connections when
its file descriptors run out.

Every connection and every segment is a file descriptor of the service. The service
raises its soft descriptor limit to the hard one at start and keeps a quarter of it
for connections (at most ``tunables.SERVICE_CONNECTIONS``) and half for segments (at
most ``tunables.SERVICE_SEGMENTS``, memory.py waits past it); one client process (by
its pid) holds at most ``tunables.CLIENT_CONNECTIONS`` connections and
``tunables.CLIENT_SEGMENTS`` segments (and a quarter of the service's at most), so one
client cannot take the others' share.
Should ``accept`` still fail for want of descriptors, ``accept_loop`` refuses that
connection with a spare descriptor kept for this, and backs off. What was refused is
counted for ``checkpointd status``. On the service's event loop. No torch here.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import resource
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

import anyio
from anyio.abc import SocketListener, SocketStream, TaskGroup

from checkpointd import tunables
from checkpointd.daemon.server.conn import Conn
from checkpointd.daemon.wire import protocol as p
from checkpointd.errors import ServiceError

__all__ = ["Admission", "accept_loop", "descriptor_limit"]

_log = logging.getLogger(__name__)

_OUT_OF = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


def descriptor_limit() -> int:
    """This process's file descriptor limit, the soft one raised to the hard one first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard not in (resource.RLIM_INFINITY, soft):
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return int(soft) if soft != resource.RLIM_INFINITY else 1 << 20


class Admission:
    """The connections of each client process, the caps, and what was refused."""

    def __init__(self, descriptors: int) -> None:
        self.max_connections = max(4, min(tunables.SERVICE_CONNECTIONS, descriptors // 4))
        self.max_segments = max(4, min(tunables.SERVICE_SEGMENTS, descriptors // 2))
        # One process gets at most a quarter of either, so others still get in.
        self.client_connections = max(
            1, min(tunables.CLIENT_CONNECTIONS, self.max_connections // 4)
        )
        self.client_segments = max(1, min(tunables.CLIENT_SEGMENTS, self.max_segments // 4))
        self.by_pid: dict[int, set[Conn]] = collections.defaultdict(set)
        self.count = 0
        self.refused: collections.Counter[str] = collections.Counter()

    def admit(self, conn: Conn) -> str | None:
        """Count ``conn`` in (None), or why it is refused (counted as refused)."""
        if self.count >= self.max_connections:
            self.refused["connections"] += 1
            return f"the service serves {self.count} connections, its most; try again later"
        if len(self.by_pid[conn.pid]) >= self.client_connections:
            self.refused["connections"] += 1
            return (
                f"process {conn.pid} holds {self.client_connections} connections to the "
                "service, the most one process may"
            )
        self.by_pid[conn.pid].add(conn)
        self.count += 1
        return None

    def leave(self, conn: Conn) -> None:
        """``conn`` (admitted) ended."""
        conns = self.by_pid[conn.pid]
        conns.discard(conn)
        if not conns:
            del self.by_pid[conn.pid]
        self.count -= 1

    def check_segment(self, conn: Conn, pending: Iterable[tuple[Conn | None, int]]) -> None:
        """ServiceError if ``conn``'s process holds ``client_segments`` already:
        allocated or being allocated on its connections, or in its writers' saves in flight
        (``pending``: each writer's connection and saves in flight)."""
        conns = self.by_pid.get(conn.pid, {conn})
        held = sum(len(c.owned) + c.asking for c in conns)
        held += sum(count for owner, count in pending if owner in conns)
        if held >= self.client_segments:
            self.refused["segments"] += 1
            raise ServiceError(
                f"process {conn.pid} holds {held} segments of the service, the most one "
                "process may (saves in flight and segments not yet submitted)"
            )


async def accept_loop(
    listener: SocketListener,
    serve: Callable[[SocketStream], Coroutine[Any, Any, None]],
    group: TaskGroup,
    refused: collections.Counter[str],
) -> None:
    """Accept connections until cancelled, each served by ``serve`` in ``group``. When
    ``accept`` fails for want of descriptors, the connection waiting is accepted on a
    spare descriptor kept for this and told so; without a spare, accepting backs off
    (up to ``tunables.ACCEPT_BACKOFF_MAX_SECONDS``) until descriptors free."""
    spare = _spare()
    delay = 0.0
    short = False  # out of descriptors since the last connection accepted (logged once)
    try:
        while True:
            if spare is None:
                spare = _spare()
            try:
                stream = await listener.accept()
            except anyio.BrokenResourceError as exc:
                cause = exc.__cause__
                if not isinstance(cause, OSError) or cause.errno not in _OUT_OF:
                    raise
                refused["descriptors"] += 1
                if not short:
                    _log.warning("out of file descriptors (%s): refusing connections", cause)
                    short = True
                if spare is not None:  # each turn answers a waiting connection: no spin
                    os.close(spare)
                    spare = None
                    await _refuse_one(listener)
                    continue
                least = tunables.ACCEPT_BACKOFF_MIN_SECONDS
                delay = min(tunables.ACCEPT_BACKOFF_MAX_SECONDS, max(least, 2 * delay))
                await anyio.sleep(delay)
                continue
            delay, short = 0.0, False
            group.start_soon(serve, stream)
    finally:
        if spare is not None:
            os.close(spare)


def _spare() -> int | None:
    """A descriptor to give up when they run out (None if none is left)."""
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


async def _refuse_one(listener: SocketListener) -> None:
    """Accept the connection waiting (if any, at once), tell it why, close it."""
    stream = None
    with anyio.move_on_after(tunables.REFUSE_ACCEPT_SECONDS):
        try:
            stream = await listener.accept()
        except anyio.BrokenResourceError:
            return
    if stream is None:
        return
    why = "the service is out of file descriptors; try again later"
    with contextlib.suppress(Exception):  # a fresh socket: the frame fits its buffer
        await stream.send(p.encode(p.Error(0, "ServiceError", why)))
    with contextlib.suppress(Exception):
        await stream.aclose()
