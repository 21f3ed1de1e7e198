"""The in-process backend of a writer: one task on an event loop writes snapshots in order.

Also what the writer knows about committed steps: the newest one, read once
when the writer starts, and the deletion of newer steps after a rollback
(``newer_steps="discard"``).
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import TYPE_CHECKING, Literal

import anyio
import anyio.to_thread
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from checkpointd.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    StagingError,
    WriterClosedError,
)
from checkpointd.format.manifest import CheckpointInfo, FileEntry, Manifest
from checkpointd.maintain.deletion import delete_checkpoints
from checkpointd.maintain.retention import (
    RetentionPolicy,
    WriterIdentity,
    apply_retention,
)
from checkpointd.read import catalog
from checkpointd.storage import Store
from checkpointd.storage.base import shown
from checkpointd.write import lifecycle
from checkpointd.write.capture import BufferPool, StagingBuffer
from checkpointd.write.commit import info_of, publish_plan
from checkpointd.write.handle import Failures, SaveHandle, first_leaf
from checkpointd.write.plan import SavePlan, Snapshot, plan_snapshot

if TYPE_CHECKING:
    from checkpointd.ranks.group import Group
    from checkpointd.write.incremental import CaptureHold, IncrementalSaver
    from checkpointd.write.staging import Staging

__all__ = ["InProcessBackend", "NewerSteps", "discard_newer", "newest_committed"]

_log = logging.getLogger(__name__)

NewerSteps = Literal["error", "keep", "discard"]


def newest_committed(store: Store) -> int | None:
    """The newest step whose manifest reads back, or None: one listing, then usually one
    manifest read. A damaged manifest is skipped (readers skip it too); one of a newer
    schema counts (a newer checkpointd committed it). Blocking; any thread."""
    for step in reversed(catalog.step_folders(store)):
        try:
            catalog.read_manifest(store, step)
        except (CheckpointNotFoundError, CorruptCheckpointError):
            continue
        except IncompatibleCheckpointError:
            return step
        return step
    return None


def discard_newer(store: Store, step: int) -> list[int]:
    """Delete every committed checkpoint newer than ``step``, newest first (each manifest
    first); folders without a manifest (saves in flight, leftovers) are left to gc.
    Returns the deleted steps. Worker thread (blocking)."""
    newer = [s for s in reversed(catalog.step_folders(store)) if s > step]
    deleted = delete_checkpoints(store, newer)
    if deleted:
        where = shown(store.url)
        _log.info("discarded steps %s of %s, newer than step %d", deleted, where, step)
    return deleted


class InProcessBackend:
    """The ``WriteBackend`` (backend.py) that plans and commits in this process: lives on
    one event loop and writes snapshots in order (the checkpoint service runs it too,
    daemon/saves.HostedBackend).

    ``newest`` is the newest committed step the writer knows of: set by the writer
    before the backend starts, then updated on the loop after each commit (read by
    the caller thread without a lock: one attribute, written before the handle resolves).
    """

    def __init__(
        self,
        store: Store,
        policy: RetentionPolicy,
        max_pending: int,
        max_concurrency: int,
        newer_steps: NewerSteps = "error",
        *,
        group: Group | None = None,
        incremental: bool = False,
        chunk_bytes: int,
        pool: BufferPool | None = None,
    ) -> None:
        self.store = store
        self.chunk_bytes = chunk_bytes
        """Bytes handed to the store per write (the writer's option)."""
        self.incremental: IncrementalSaver | None = None
        """Set for ``incremental=True``: references unchanged tensors (incremental.py)."""
        if incremental:
            from checkpointd.write.incremental import IncrementalSaver

            self.incremental = IncrementalSaver(store)
        self.group = group
        """The ranks that save together (None: this process alone); see ranks/group.py."""
        self.policy = policy
        self.identity = WriterIdentity.for_root(store.url)  # in its manifests; see retention
        self._manifests: dict[int, Manifest] = {}  # read by retention passes, reused
        self.max_pending = max_pending
        self.max_concurrency = max_concurrency
        self.newer_steps = newer_steps
        self.newest: int | None = None
        self.loop_thread: int | None = None
        self.failures = Failures()
        self._generation = lifecycle.generation()
        self._pool = pool  # where the buffers come from and go back to (None: their own)
        self._buffers = [
            StagingBuffer() if pool is None else pool.take() for _ in range(max_pending)
        ]
        self._free: (
            tuple[MemoryObjectSendStream[StagingBuffer], MemoryObjectReceiveStream[StagingBuffer]]
            | None
        ) = None
        self._queue: (
            tuple[
                MemoryObjectSendStream[tuple[Snapshot, SaveHandle]],
                MemoryObjectReceiveStream[tuple[Snapshot, SaveHandle]],
            ]
            | None
        ) = None

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve queued snapshots until ``stop()``; reports started once it accepts saves."""
        self.loop_thread = threading.get_ident()
        limiter = anyio.CapacityLimiter(self.max_concurrency)
        self._free = anyio.create_memory_object_stream[StagingBuffer](self.max_pending)
        for buffer in self._buffers:
            self._free[0].send_nowait(buffer)
        self._queue = anyio.create_memory_object_stream[tuple[Snapshot, SaveHandle]](
            self.max_pending
        )
        task_status.started()
        async with self._queue[1] as queue, self._free[0], self._free[1]:
            async for snapshot, handle in queue:
                await self._write(snapshot, handle, limiter)

    async def _write(
        self, snapshot: Snapshot, handle: SaveHandle, limiter: anyio.CapacityLimiter
    ) -> None:
        """Write one snapshot, discard newer steps if asked, run retention, then resolve its
        handle (in that order)."""
        if lifecycle.inherited(self._generation):
            # A fork child running a copy of the caller's loop: the save is the parent's.
            self.release_buffer(snapshot.buffer)
            handle.resolve(None, WriterClosedError("the writer was inherited through fork()"))
            return
        try:
            try:
                if handle.staging is not None:  # overlapped: the copy may still run
                    await self._staged(handle.staging, snapshot)
                self.identity.follow_resume()  # a restore since the writer was made
                info = await self._commit(snapshot, limiter)
            finally:
                self.release_buffer(snapshot.buffer)  # the next save may capture now
        except Exception as exc:
            error = first_leaf(exc)
            self.failures.add(error)
            handle.resolve(None, error)
            return
        except BaseException:
            handle.resolve(None, WriterClosedError("the writer stopped during this save"))
            raise
        try:
            if self.group is not None and not self.group.publishes:
                self.newest = max(info.step, -1 if self.newest is None else self.newest)
                return  # the publishing rank discards newer steps and runs retention
            if self.newer_steps == "discard":
                self.newest = info.step
                await anyio.to_thread.run_sync(
                    discard_newer, self.store, info.step, limiter=limiter
                )
            else:
                self.newest = max(info.step, -1 if self.newest is None else self.newest)
            # After the discard: retention must not count the abandoned steps as the newest.
            await apply_retention(
                self.store,
                self.policy,
                limiter,
                committed_step=info.step,
                identity=self.identity,
                known=self._manifests,
            )
        except Exception as exc:
            # The checkpoint is committed; the failure is reported on its own.
            error = first_leaf(exc)
            why = shown(f"{type(error).__name__}: {error}")
            _log.warning("step %d is committed; what follows a commit failed: %s", info.step, why)
            self.failures.add(error)
        finally:
            handle.resolve(info, None)

    async def _staged(self, staging: Staging, snapshot: Snapshot) -> None:
        """Wait for a save's background copy; if it failed, abandon this attempt for every
        rank of the group first (they fail at once, not after join_seconds), then raise."""
        try:
            await staging.wait_async()
        except StagingError as exc:
            if self.group is not None:
                from checkpointd.ranks.attempt import abandon

                why = f"its staging failed ({exc})"
                await anyio.to_thread.run_sync(
                    abandon, self.group, snapshot.step, snapshot.attempt, why
                )
            raise

    async def _commit(self, snapshot: Snapshot, limiter: anyio.CapacityLimiter) -> CheckpointInfo:
        """Plan and commit one snapshot (incrementally if asked): alone, or as this rank's
        part of a group's save."""
        group = self.group
        token = None if group is None else f"{group.token}{snapshot.attempt}"
        world_size = 1 if group is None else group.world_size
        durable = functools.partial(self._durable, limiter=limiter, number=snapshot.attempt)
        if self.incremental is not None:
            begun: list[SavePlan] = []

            async def begin(plan: SavePlan) -> tuple[CheckpointInfo, Manifest | None]:
                begun.append(plan)
                return await durable(plan)

            try:
                info = await self.incremental.commit(
                    snapshot, limiter, begin, token=token, world_size=world_size
                )
            except BaseException as exc:
                if group is not None and not begun:  # the others would wait for this rank
                    from checkpointd.ranks.attempt import abandon

                    error = first_leaf(exc)
                    why = f"{type(error).__name__}: {error}"
                    with anyio.CancelScope(shield=True):
                        await anyio.to_thread.run_sync(
                            abandon, group, snapshot.step, snapshot.attempt, why
                        )
                raise
        else:
            plan = await anyio.to_thread.run_sync(
                functools.partial(plan_snapshot, snapshot, token, world_size=world_size)
            )
            info, _ = await durable(plan)
        return info

    async def _durable(
        self, plan: SavePlan, *, limiter: anyio.CapacityLimiter, number: int
    ) -> tuple[CheckpointInfo, Manifest | None]:
        """Make ``plan`` durable, the one way for every kind of save: commit.publish_plan
        alone, write.ranked_commit.commit_ranked (attempt ``number``) with a group. Returns the
        CheckpointInfo and the manifest where this process has it (alone; a rank reads
        only the publisher's summary)."""
        if self.group is None:
            manifest = await publish_plan(
                self.store, plan, limiter, identity=self.identity, chunk_bytes=self.chunk_bytes
            )
            self.committed_plan(plan, manifest.files)
            return info_of(self.store, manifest), manifest
        from checkpointd.write.ranked_commit import commit_ranked

        written: list[FileEntry] = []
        info = await commit_ranked(
            self.store,
            plan,
            limiter,
            self.group,
            number,
            identity=self.identity,
            chunk_bytes=self.chunk_bytes,
            written=written,
        )
        self.committed_plan(plan, written)
        return info, None

    def committed_plan(self, plan: SavePlan, written: list[FileEntry]) -> None:
        """Called on the loop with each plan once it is committed, and the entries of the
        files this process wrote of it (sizes, CRC32Cs), before its handle resolves;
        nothing here (the checkpoint service's writers keep them for their memory tier)."""

    def hold_unchanged(self) -> CaptureHold | None:
        """What capture may skip as unchanged (incremental only); caller's thread."""
        return None if self.incremental is None else self.incremental.hold()

    async def acquire_buffer(self) -> StagingBuffer:
        """Wait for a free staging buffer (at most ``max_pending`` saves exist at once)."""
        assert self._free is not None
        return await self._free[1].receive()

    def release_buffer(self, buffer: StagingBuffer) -> None:
        """Return a buffer to the pool; on the event loop."""
        assert self._free is not None
        self._free[0].send_nowait(buffer)

    async def submit(self, snapshot: Snapshot, handle: SaveHandle) -> None:
        """Queue a captured snapshot (its handle made with ``failures=self.failures``); never
        blocks (the queue holds max_pending)."""
        assert self._queue is not None
        await self._queue[0].send((snapshot, handle))

    async def stop(self) -> None:
        """Let queued saves finish, then end ``run``."""
        if self._queue is not None:
            await self._queue[0].aclose()

    def close_store(self) -> None:
        """Release the store's resources (and stop the heartbeat) once the backend has stopped;
        the staging buffers go back to the pool they came from."""
        if self._pool is not None:
            self._pool.give_back(self._buffers)
            self._buffers = []
        if self.group is not None:
            self.group.close()
        if self.incremental is not None:
            self.incremental.close()
        self.store.close()

    def take_unseen_error(self) -> BaseException | None:
        """The oldest error nobody has seen raised, marked seen (for the exit report)."""
        return self.failures.take_first()
