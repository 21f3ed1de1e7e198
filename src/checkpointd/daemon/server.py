"""The service process (``checkpointd serve``): one per node and user.

One anyio event loop (asyncio). Each connection is served by a task of its own,
so a client that sends garbage, stalls inside a frame or hangs up only ends its
own connection. Each writer that opens through the service gets a write service
of today's kind (``write.loop.WriteService``: plan, commit protocol, retention)
whose snapshots live in the segments the trainers captured into. A submitted
save belongs to the service: it commits whether or not its client is still
there. Segments allocated and never submitted are freed when their connection
ends (a trainer killed while copying). Imports torch.

Who owns what: a segment is the connection's from ``Alloc`` until ``Submit``
(or ``Free``), then the save's until it resolves, then the memory tier's (if it
committed and the tier keeps it) until evicted. ``memory_limit`` bounds the sum.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread
import torch
from anyio.abc import SocketAttribute, SocketStream, TaskGroup

from checkpointd import errors, tunables
from checkpointd.errors import CheckpointError, ServiceMemoryError
from checkpointd.maintain.retention import RetentionPolicy
from checkpointd.storage import open_store
from checkpointd.write.handle import SaveHandle, first_leaf
from checkpointd.write.loop import WriteService, newest_committed
from checkpointd.write.plan import Snapshot

from . import protocol as p
from .memtier import MemoryTier, root_key
from .paths import lock_or_fail, peer_uid, prepare_folder, remove_stale
from .shm import MappedSegment, readonly_fd
from .snapshot import held_checkpoint, rebuild

__all__ = ["Server", "serve"]

_log = logging.getLogger("checkpointd.write.loop")


class HostedWriteService(WriteService):
    """Today's write service, for snapshots in segments: they are not the pool's, the
    server frees or keeps them once the save resolves."""

    def release_buffer(self, buffer: Any) -> None:
        """Not returned to the pool: the memory tier may keep the segment's bytes, or
        ``Server._finish`` frees them, once the save has resolved."""


@dataclass
class _Writer:
    ident: int
    key: str
    service: HostedWriteService
    conn: _Conn | None
    pending: int = 0


@dataclass
class _Conn:
    stream: SocketStream
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    open: bool = True
    owned: dict[int, MappedSegment] = field(default_factory=dict)

    async def send(self, message: p.Message, fds: list[int] | None = None) -> None:
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


class Server:
    """The service's state, on its event loop."""

    def __init__(
        self,
        socket_path: str,
        *,
        memory_limit: int | None = None,
        keep_in_memory: int = 1,
        idle_exit: float | None = None,
    ) -> None:
        self.socket_path = os.path.abspath(socket_path)
        self.memory_limit = memory_limit
        self.idle_exit = idle_exit
        self.tier = MemoryTier(keep_in_memory, self._release)
        self.segments: dict[int, MappedSegment] = {}
        self._spare: MappedSegment | None = None
        """The last freed segment, kept for the next save of a similar size: a fresh
        memfd costs a page fault and a zeroed page per 4 KiB on first touch."""
        self.writers: dict[int, _Writer] = {}
        self.clients = 0
        self.in_flight = 0
        self.committed = 0
        self.failed = 0
        self._ids = itertools.count(1)
        self._freed = anyio.Event()
        self._quiet_since = time.monotonic()
        self._group: TaskGroup | None = None

    # -- memory -----------------------------------------------------------------

    @property
    def bytes_held(self) -> int:
        """Every byte of shared memory held: staged, kept and the spare."""
        spare = 0 if self._spare is None else self._spare.capacity
        return sum(s.capacity for s in self.segments.values()) + spare

    def _release(self, segment: MappedSegment) -> None:
        if segment.ident in self.segments:
            del self.segments[segment.ident]
            if self._spare is not None:
                self._spare.close()
            self._spare = segment
            self._freed.set()
            self._freed = anyio.Event()

    def _drop_spare(self) -> bool:
        spare, self._spare = self._spare, None
        if spare is not None:
            spare.close()
        return spare is not None

    async def _allocate(self, nbytes: int) -> MappedSegment:
        """A new segment of ``nbytes``: evicts held checkpoints, then waits, while it would
        pass the memory limit; ServiceMemoryError if it can never fit."""
        limit = self.memory_limit
        if nbytes < 0:
            raise p.ProtocolError(f"a segment of {nbytes} bytes was asked for")
        if limit is not None and nbytes > limit:
            raise ServiceMemoryError(
                f"this save needs {nbytes} bytes of shared memory; the service's "
                f"--memory-limit is {limit}: it can never fit (raise the limit)"
            )
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if nbytes > physical:
            raise ServiceMemoryError(
                f"this save needs {nbytes} bytes of shared memory; this machine has "
                f"{physical}: it can never fit"
            )
        spare = self._spare
        if spare is not None and nbytes <= spare.capacity <= 2 * max(nbytes, 1):
            self._spare = None
            segment = spare.reuse(next(self._ids), nbytes)
            self.segments[segment.ident] = segment
            return segment
        while limit is not None and self.bytes_held + nbytes > limit:
            if not (self._drop_spare() or self.tier.evict_oldest()):
                await self._freed.wait()  # a save in flight resolves, or a client frees
        segment = MappedSegment(next(self._ids), nbytes)
        self.segments[segment.ident] = segment
        return segment

    # -- the process ------------------------------------------------------------

    async def run(self) -> None:
        """Listen until SIGTERM/SIGINT (or ``idle_exit``), then finish saves in flight."""
        folder = prepare_folder(self.socket_path)
        lock = lock_or_fail(self.socket_path)
        try:
            remove_stale(self.socket_path)
            listener = await anyio.create_unix_listener(self.socket_path, mode=0o600)
            os.chmod(folder, 0o700)
            _log.info("serving at %s (pid %d)", self.socket_path, os.getpid())
            async with anyio.create_task_group() as group:
                self._group = group
                with anyio.CancelScope() as listening:
                    group.start_soon(self._watch, listening)
                    await listener.serve(self._connection, task_group=group)
                await listener.aclose()
                await self._drain()
                group.cancel_scope.cancel()
        finally:
            with contextlib.suppress(OSError):
                os.unlink(self.socket_path)
            self.tier.clear()
            self._drop_spare()
            os.close(lock)
        _log.info("stopped")

    async def _watch(self, listening: anyio.CancelScope) -> None:
        """End listening at SIGTERM/SIGINT, or when idle for ``idle_exit`` seconds."""
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with anyio.create_task_group() as group:

                async def idle() -> None:
                    while True:
                        await anyio.sleep(0.2)
                        busy = self.clients or self.in_flight
                        if busy:
                            self._quiet_since = time.monotonic()
                        elif self.idle_exit is not None and (
                            time.monotonic() - self._quiet_since >= self.idle_exit
                        ):
                            _log.info("idle for %ss: exiting", self.idle_exit)
                            break
                    group.cancel_scope.cancel()

                group.start_soon(idle)
                async for signum in signals:
                    _log.info("signal %d: finishing saves in flight, then exiting", signum)
                    break
                group.cancel_scope.cancel()
        listening.cancel()

    async def _drain(self) -> None:
        """Let every writer finish its queue (saves already submitted commit)."""
        for writer in list(self.writers.values()):
            await writer.service.stop()
        while self.in_flight:
            await self._freed.wait()  # set as each save resolves

    async def _connection(self, stream: SocketStream) -> None:
        conn = _Conn(stream)
        raw: socket.socket = stream.extra(SocketAttribute.raw_socket)
        try:
            uid = peer_uid(raw)
        except OSError:
            uid = -1
        if uid != os.getuid():
            _log.warning("refused a connection from uid %d", uid)
            await conn.send(p.Error(0, "ServiceError", "this service serves its own user only"))
            await stream.aclose()
            return
        self.clients += 1
        buffer = bytearray()
        try:
            while True:
                try:
                    message = await p.read_async(stream, buffer)
                except p.ProtocolError as exc:
                    await conn.send(p.Error(0, "ProtocolError", str(exc)))
                    break
                if message is None:
                    break
                try:
                    await self._handle(conn, message)
                except p.ProtocolError as exc:
                    await conn.send(p.Error(getattr(message, "id", 0), "ProtocolError", str(exc)))
                    break
                except CheckpointError as exc:
                    await conn.send(
                        p.Error(getattr(message, "id", 0), type(exc).__name__, str(exc))
                    )
                except Exception as exc:  # a bug or an OS failure: this client only
                    _log.exception("request %s failed", type(message).__name__)
                    why = f"the service failed this request ({type(exc).__name__}: {exc})"
                    await conn.send(p.Error(getattr(message, "id", 0), "ServiceError", why))
                    break
        finally:
            conn.open = False
            for segment in list(conn.owned.values()):
                self._release(segment)  # captured into but never submitted
            conn.owned.clear()
            for writer in list(self.writers.values()):
                if writer.conn is conn:
                    writer.conn = None
                    self._retire(writer)
            self.clients -= 1
            with contextlib.suppress(Exception):
                await stream.aclose()

    async def _handle(self, conn: _Conn, message: p.Message) -> None:
        match message:
            case p.OpenWriter():
                writer = await self._open_writer(conn, message)
                await conn.send(p.WriterOpened(message.id, writer.ident))
            case p.Alloc(id=ident, nbytes=nbytes):
                segment = await self._allocate(nbytes)
                conn.owned[segment.ident] = segment
                await conn.send(p.Segment(ident, segment.ident, nbytes), [segment.fd])
            case p.Free(id=ident, segment=number):
                if (freed := conn.owned.pop(number, None)) is not None:
                    self._release(freed)
                await conn.send(p.Ok(ident))
            case p.Submit():
                await self._submit(conn, message)
            case p.Lookup():
                await self._lookup(conn, message)
            case p.Status(id=ident):
                await conn.send(self.status(ident))
            case _:
                raise p.ProtocolError(f"a {type(message).__name__} is not a request")

    async def _open_writer(self, conn: _Conn, message: p.OpenWriter) -> _Writer:
        if message.newer_steps not in ("error", "keep", "discard"):
            raise errors.InvalidArgumentError(f"newer_steps {message.newer_steps!r}")
        if message.best_mode not in ("min", "max"):
            raise errors.InvalidArgumentError(f"best_mode {message.best_mode!r}")
        policy = RetentionPolicy(
            message.keep_last,
            message.keep_every,
            message.keep_best,
            message.best_metric,
            message.best_mode,  # type: ignore[arg-type]
        )
        if not 1 <= message.max_pending <= 64 or not 1 <= message.max_concurrency <= 256:
            raise errors.InvalidArgumentError("max_pending or max_concurrency out of range")
        store = await anyio.to_thread.run_sync(open_store, message.root, message.storage_options)
        service = HostedWriteService(
            store,
            policy,
            message.max_pending,
            message.max_concurrency,
            message.newer_steps,  # type: ignore[arg-type]
            chunk_bytes=tunables.CHUNK_BYTES,
        )
        service.newest = await anyio.to_thread.run_sync(newest_committed, store)
        assert self._group is not None
        await self._group.start(service.run)
        writer = _Writer(
            next(self._ids), root_key(message.root, message.storage_options), service, conn
        )
        self.writers[writer.ident] = writer
        return writer

    def _retire(self, writer: _Writer) -> None:
        """A writer whose client is gone and nothing pending: stop its service."""
        if writer.conn is None and writer.pending == 0 and writer.ident in self.writers:
            del self.writers[writer.ident]
            assert self._group is not None

            async def stop() -> None:
                await writer.service.stop()
                writer.service.close_store()

            self._group.start_soon(stop)

    async def _submit(self, conn: _Conn, message: p.Submit) -> None:
        writer = self.writers.get(message.writer)
        if writer is None or writer.conn is not conn:
            raise p.ProtocolError(f"writer {message.writer} is not this connection's")
        segment = conn.owned.get(message.segment)
        if segment is None:
            raise p.ProtocolError(f"segment {message.segment} is not this connection's")
        arena = torch.frombuffer(segment.map, dtype=torch.uint8, count=max(segment.size, 1))
        snapshot = rebuild(message.snapshot, arena[: segment.size])
        del conn.owned[message.segment]  # the save owns it now
        save = next(self._ids)
        handle = SaveHandle(
            snapshot.step, time.perf_counter(), anyio.Event(), failures=writer.service.failures
        )
        writer.pending += 1
        self.in_flight += 1
        try:
            await writer.service.submit(snapshot, handle)
        except BaseException:
            writer.pending -= 1
            self.in_flight -= 1
            self._release(segment)
            raise
        await conn.send(p.Accepted(message.id, save))
        assert self._group is not None
        self._group.start_soon(self._finish, writer, save, handle, snapshot, segment)

    async def _finish(
        self,
        writer: _Writer,
        save: int,
        handle: SaveHandle,
        snapshot: Snapshot,
        segment: MappedSegment,
    ) -> None:
        """Once a save resolves: tell its client (if still there), keep or free its segment."""
        try:
            try:
                info = await handle.wait()
            except Exception as exc:
                error = first_leaf(exc)
                self.failed += 1
                _log.warning("step %d of %s failed: %s", snapshot.step, writer.key, error)
                self._release(segment)
                if writer.conn is not None:
                    await writer.conn.send(p.Failed(save, type(error).__name__, str(error)))
                return
            self.committed += 1
            try:
                held = await anyio.to_thread.run_sync(
                    held_checkpoint, writer.service, snapshot, segment
                )
            except Exception as exc:  # reading the manifest back failed: do not hold it
                _log.warning("not holding step %d in memory: %r", snapshot.step, exc, exc_info=True)
                held = None
            if held is None:
                self._release(segment)
            else:
                self.tier.add(writer.key, held)
            if writer.conn is not None:
                await writer.conn.send(p.Committed(save, info))
            while (later := writer.service.failures.take_first()) is not None:
                if writer.conn is not None:
                    await writer.conn.send(p.Notice(writer.ident, type(later).__name__, str(later)))
        finally:
            writer.pending -= 1
            self.in_flight -= 1
            self._retire(writer)
            self._freed.set()
            self._freed = anyio.Event()

    async def _lookup(self, conn: _Conn, message: p.Lookup) -> None:
        held = self.tier.find(root_key(message.root, message.storage_options), message.step)
        if held is None:
            await conn.send(p.NotHeld(message.id))
            return
        fd = readonly_fd(held.segment.fd)
        try:
            reply = p.Held(message.id, held.step, held.manifest, held.files, held.segment.size)
            await conn.send(reply, [fd])
        finally:
            os.close(fd)

    def status(self, ident: int) -> p.StatusReply:
        kept = self.tier.nbytes
        spare = 0 if self._spare is None else self._spare.capacity
        return p.StatusReply(
            id=ident,
            pid=os.getpid(),
            saves_in_flight=self.in_flight,
            bytes_staged=self.bytes_held - kept - spare,
            bytes_kept=kept,
            memory_limit=self.memory_limit,
            kept=self.tier.steps(),
            clients=self.clients - 1,  # not counting the one asking
            committed=self.committed,
            failed=self.failed,
        )


def serve(
    socket_path: str,
    *,
    memory_limit: int | None = None,
    keep_in_memory: int = 1,
    idle_exit: float | None = None,
) -> None:
    """Run the service in the foreground until SIGTERM/SIGINT or ``idle_exit``."""
    if keep_in_memory < 0:
        raise errors.InvalidArgumentError(
            f"--keep-in-memory must be 0 or more, not {keep_in_memory}"
        )
    if idle_exit is not None and idle_exit <= 0:
        raise errors.InvalidArgumentError(f"--idle-exit must be positive, not {idle_exit}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s checkpointd serve: %(message)s")
    server = Server(
        socket_path, memory_limit=memory_limit, keep_in_memory=keep_in_memory, idle_exit=idle_exit
    )
    anyio.run(server.run, backend="asyncio")
