"""The service's writers and the saves submitted to them.

Each writer that opens through the service gets the in-process backend
(``write.loop.InProcessBackend``: plan, commit protocol, retention), hosted here as
``HostedBackend``, whose snapshots live in the segments the trainers captured into,
laid out by the layout its trainer sent when the writer opened. A submitted save
belongs to the service: it commits whether or not its client is still there;
once it resolves its segment goes to the memory tier (committed and kept) or
back to shared memory. A writer whose client is gone is stopped once nothing of
it is pending. On the service's event loop. Imports torch.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import torch
from anyio.abc import TaskGroup

from checkpointd import errors, tunables
from checkpointd.daemon.server.conn import Conn
from checkpointd.daemon.server.held import Committed, held_checkpoint
from checkpointd.daemon.server.memory import SharedMemory
from checkpointd.daemon.server.memtier import MemoryTier, RootKey, root_key
from checkpointd.daemon.wire import protocol as p
from checkpointd.daemon.wire.shm import MappedSegment
from checkpointd.daemon.wire.snapshot import rebuild
from checkpointd.format.layout import SaveLayout
from checkpointd.format.manifest import FileEntry
from checkpointd.maintain.retention import RetentionPolicy
from checkpointd.ranks.hosted import open_hosted
from checkpointd.storage import open_store
from checkpointd.write.handle import SaveHandle, first_leaf
from checkpointd.write.loop import InProcessBackend, newest_committed
from checkpointd.write.plan import SavePlan, Snapshot

__all__ = ["HostedBackend", "Saves"]

_log = logging.getLogger(__name__)


class HostedBackend(InProcessBackend):
    """The in-process backend, run by the service for one client's writer, for snapshots
    in segments: they are not the pool's, the service frees or keeps them once the save
    resolves; the plan each committed with is kept until then, for the memory tier
    (held.py)."""

    def release_buffer(self, buffer: Any) -> None:
        """Not returned to the pool: the memory tier may keep the segment's bytes, or
        ``Saves`` frees them, once the save has resolved."""

    def committed_plan(self, plan: SavePlan, written: list[FileEntry]) -> None:
        """Keep ``plan`` (just committed) and the entries of the files written of it until
        ``take_plan`` (its save's ``_finish``)."""
        self.plans[plan.step] = Committed(plan, written)

    def take_plan(self, step: int) -> Committed | None:
        """What ``step`` committed, forgotten here (None if it did not commit)."""
        return self.plans.pop(step, None)

    @functools.cached_property
    def plans(self) -> dict[int, Committed]:
        """What the saves that have not finished yet committed, by step."""
        return {}


@dataclass
class Writer:
    ident: int
    key: RootKey
    """Its root (shown without its storage options' values: ``str(key)``)."""
    service: HostedBackend
    conn: Conn | None
    layout: SaveLayout
    """Every snapshot's layout: the trainer's (``OpenWriter.layout``)."""
    pending: int = 0


class Saves:
    """The writers of every client, and the saves in flight. Event loop."""

    def __init__(self, memory: SharedMemory, tier: MemoryTier, group: TaskGroup) -> None:
        self.memory = memory
        self.tier = tier
        self.group = group
        self.writers: dict[int, Writer] = {}
        self.in_flight = 0
        self.committed = 0
        self.failed = 0
        self._ids = 0

    def _next(self) -> int:
        self._ids += 1
        return self._ids

    async def open_writer(self, conn: Conn, message: p.OpenWriter) -> Writer:
        """Start a backend for ``message``'s target and options, ``conn``'s; ProtocolError
        for a relative root (it would be this process's working folder's, not the client's),
        InvalidArgumentError for an option or layout out of range."""
        key = root_key(message.root, message.storage_options)
        layout = SaveLayout.now() if message.layout is None else message.layout
        layout.check()
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
        chunk_bytes = tunables.CHUNK_BYTES if message.chunk_bytes is None else message.chunk_bytes
        if chunk_bytes < 1:
            raise errors.InvalidArgumentError(f"chunk_bytes {chunk_bytes} out of range")
        store = await anyio.to_thread.run_sync(open_store, message.root, message.storage_options)
        group = None
        if message.group is not None:
            try:
                group = await anyio.to_thread.run_sync(open_hosted, message.group)
            except Exception as exc:
                store.close()
                raise errors.RankFailedError(
                    f"the service cannot reach the job's store at {message.group.host}:"
                    f"{message.group.port} ({type(exc).__name__}: {exc})"
                ) from None
        service = HostedBackend(
            store,
            policy,
            message.max_pending,
            message.max_concurrency,
            message.newer_steps,  # type: ignore[arg-type]
            incremental=message.incremental,
            group=group,
            chunk_bytes=chunk_bytes,
        )
        service.newest = await anyio.to_thread.run_sync(newest_committed, store)
        await self.group.start(service.run)
        writer = Writer(self._next(), key, service, conn, layout)
        self.writers[writer.ident] = writer
        return writer

    def client_gone(self, conn: Conn) -> None:
        """``conn`` ended: its writers stop once nothing of theirs is pending."""
        for writer in list(self.writers.values()):
            if writer.conn is conn:
                writer.conn = None
                self._retire(writer)

    def _retire(self, writer: Writer) -> None:
        """A writer whose client is gone and nothing pending: stop its service."""
        if writer.conn is None and writer.pending == 0 and writer.ident in self.writers:
            del self.writers[writer.ident]
            self.memory.trim_spares()  # one writer fewer: one spare fewer is kept

            async def stop() -> None:
                await writer.service.stop()
                writer.service.close_store()

            self.group.start_soon(stop)

    async def submit(self, conn: Conn, message: p.Submit) -> None:
        """Queue ``message``'s snapshot on its writer; ``Accepted`` once queued."""
        writer = self.writers.get(message.writer)
        if writer is None or writer.conn is not conn:
            raise p.ProtocolError(f"writer {message.writer} is not this connection's")
        segment = conn.owned.get(message.segment)
        if segment is None:
            raise p.ProtocolError(f"segment {message.segment} is not this connection's")
        arena = torch.frombuffer(segment.map, dtype=torch.uint8, count=max(segment.size, 1))
        snapshot = rebuild(message.snapshot, arena[: segment.size], writer.layout)
        del conn.owned[message.segment]  # the save owns it now
        save = self._next()
        handle = SaveHandle(
            snapshot.step,
            time.perf_counter(),
            anyio.Event(),
            failures=writer.service.failures,
            where=str(writer.key),  # its log lines name the root as shown_root shows it
        )
        writer.pending += 1
        self.in_flight += 1
        try:
            await writer.service.submit(snapshot, handle)
        except BaseException:
            writer.pending -= 1
            self.in_flight -= 1
            self.memory.release(segment)
            raise
        await conn.send(p.Accepted(message.id, save))
        self.group.start_soon(self._finish, writer, save, handle, snapshot, segment)

    async def _finish(
        self,
        writer: Writer,
        save: int,
        handle: SaveHandle,
        snapshot: Snapshot,
        segment: MappedSegment,
    ) -> None:
        """Once a save resolves: tell its client (if still there), keep or free its segment."""
        try:
            committed = None
            try:
                info = await handle.wait()
                committed = writer.service.take_plan(snapshot.step)
            except Exception as exc:
                error = first_leaf(exc)
                self.failed += 1
                self.memory.release(segment)
                if writer.conn is not None:
                    await writer.conn.send(p.Failed(save, type(error).__name__, str(error)))
                return
            self.committed += 1
            try:
                held = await anyio.to_thread.run_sync(
                    held_checkpoint, writer.service, snapshot, committed, segment
                )
            except Exception as exc:  # reading the manifest back failed: do not hold it
                _log.warning("not holding step %d in memory: %r", snapshot.step, exc, exc_info=True)
                held = None
            if held is None:
                self.memory.release(segment)
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
            self.memory.notify()

    async def drain(self) -> None:
        """Let every writer finish its queue (saves already submitted commit)."""
        for writer in list(self.writers.values()):
            await writer.service.stop()
        while self.in_flight:
            await self.memory.wait()  # notified as each save resolves
