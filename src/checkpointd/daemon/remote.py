"""The writer's side of a save through the service: a stand-in for ``WriteService``.

``CheckpointWriter(root, service=...)`` runs a ``RemoteService`` where it would
run its in-process write service. ``save()`` works as always: a staging buffer
is acquired (at most ``max_pending`` saves in flight), the state is captured by
today's capture code into it (the buffer's arena is a fresh segment of the
service's shared memory, asked for at the size capture needs), then ``submit``
sends the snapshot's description and returns once the service has accepted
it: from then on the checkpoint commits even if this process dies. The handle
resolves when the service reports the commit or the failure; if the service
goes away, every pending handle fails with ServiceError at once. Imports torch.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import msgspec
import torch
from anyio.abc import TaskStatus

from checkpointd.errors import InvalidArgumentError, ServiceError
from checkpointd.maintain.retention import RetentionPolicy
from checkpointd.write.capture import StagingBuffer
from checkpointd.write.handle import Failures, SaveHandle
from checkpointd.write.options import WriterOptions
from checkpointd.write.plan import Snapshot

from . import protocol as p
from .client import Connection, connect, error_from
from .shm import map_fd
from .snapshot import describe

if TYPE_CHECKING:
    from checkpointd.ranks.group import Group

__all__ = ["RemoteService", "open_remote"]


def open_remote(
    root: str, options: WriterOptions, group: Group | None, *, in_callers_loop: bool
) -> RemoteService:
    """The RemoteService of a writer of ``root`` made with ``service=`` (in ``options``);
    ``group``: the ranks it saves with, re-keyed for the service (ranks/hosted.py), or
    None; ``in_callers_loop``: an AsyncCheckpointWriter.
    InvalidArgumentError for an option the service does not support yet, ServiceError
    if no service answers (or, with "auto", none could be started)."""
    unsupported = [
        what
        for what, used in (
            ('staging="overlapped"', options.staging != "blocking"),
            ("AsyncCheckpointWriter", in_callers_loop),
            (
                "buffer_pool (the service's shared memory is its buffers)",
                options.buffer_pool is not None,
            ),
        )
        if used
    ]
    if unsupported:
        raise InvalidArgumentError(
            f"the checkpoint service does not support {', '.join(unsupported)} yet: "
            "use service=None for this writer"
        )
    service = options.service_path
    assert service is not None
    storage_options = options.storage_options
    try:
        plain = (
            None
            if storage_options is None
            else msgspec.json.decode(msgspec.json.encode(storage_options))
        )
    except (TypeError, msgspec.EncodeError) as exc:
        raise InvalidArgumentError(
            f"storage_options must be JSON-able to reach the checkpoint service: {exc}"
        ) from None
    conn = connect(service)
    try:
        return RemoteService(
            conn,
            root,
            storage_options=plain,
            policy=options.policy,
            max_pending=options.max_pending,
            max_concurrency=options.max_concurrency,
            newer_steps=options.newer_steps,
            incremental=options.incremental,
            chunk_bytes=options.chunk_bytes,
            group=group,
        )
    except BaseException:
        conn.close()
        raise


class _Mappings:
    """This process's mappings of the last segments it captured into, by memfd inode.

    The service hands a freed segment out again for the next save of a similar
    size; mapping it anew would set up every page again (measured: the main cost
    of ``save()`` over the in-process writer). Only the last ``KEEP`` are kept: in
    steady state those are the segment being filled and the one the service keeps
    in memory (or as its spare), so no memory stays alive only because of us for
    longer than one save. Any thread."""

    KEEP = 2

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int], mmap.mmap] = {}
        self._lock = threading.Lock()

    def map(self, fd: int, size: int) -> mmap.mmap:
        """A writable mapping of at least ``size`` bytes of segment ``fd`` (closed here)."""
        try:
            info = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        key = (info.st_dev, info.st_ino)
        with self._lock:
            found = self._maps.pop(key, None)
        if found is not None and len(found) >= max(size, 1):
            os.close(fd)
        else:
            if found is not None:
                _unmap(found)
            found = map_fd(fd, size, writable=True)
        with self._lock:
            self._maps[key] = found
            while len(self._maps) > self.KEEP:
                _unmap(self._maps.pop(next(iter(self._maps))))
        return found

    def close(self) -> None:
        with self._lock:
            maps, self._maps = list(self._maps.values()), {}
        for mapped in maps:
            _unmap(mapped)


def _unmap(mapped: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # tensors over it still alive: unmapped when
        mapped.close()  # they go


class _SegmentBuffer(StagingBuffer):
    """A staging buffer whose arena is a new service segment at each reserve."""

    def __init__(self, conn: Connection, mappings: _Mappings) -> None:
        super().__init__(self._allocate)
        self._conn = conn
        self._mappings = mappings
        self.segment: int | None = None
        self._pinned: int | None = None  # the address registered with CUDA

    def _allocate(self, nbytes: int, pinned: bool) -> torch.Tensor:
        self.forget()
        reply, fd = self._conn.request(p.Alloc, nbytes=nbytes)
        assert isinstance(reply, p.Segment)
        assert fd is not None
        self.segment = reply.segment
        mapped = self._mappings.map(fd, nbytes)
        arena = torch.frombuffer(mapped, dtype=torch.uint8, count=max(nbytes, 1))
        if pinned and torch.cuda.is_available():
            _cudart().cudaHostRegister(arena.data_ptr(), arena.numel(), 0)
            self._pinned = arena.data_ptr()
        return arena[:nbytes] if nbytes else arena

    def forget(self) -> None:
        """Drop the arena; the segment is no longer ours (its mapping stays in
        ``_Mappings`` for a later save that gets the same segment again)."""
        self.drop()
        self.segment = None
        if self._pinned is not None:
            _cudart().cudaHostUnregister(self._pinned)
            self._pinned = None


def _cudart() -> Any:
    """The CUDA runtime, to page-lock a segment for CUDA sources (cudaHostRegister) so
    their copies stay DMA, and to unlock it before it is unmapped."""
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


class RemoteService:
    """What a CheckpointWriter with ``service=`` runs instead of a WriteService.

    ``acquire_buffer``/``release_buffer``/``submit`` are called on the writer's loop
    thread as with WriteService; handles are resolved by the connection's reader
    thread (a sync writer's handles are thread-safe)."""

    incremental: None = None
    """With ``incremental=True`` the service's write service references unchanged
    tensors (the same files as in-process); the capture here copies every tensor
    (no hash instead of a copy: that needs the saver's state, which is the service's)."""

    def __init__(
        self,
        conn: Connection,
        root: str,
        *,
        storage_options: dict[str, Any] | None,
        policy: RetentionPolicy,
        max_pending: int,
        max_concurrency: int,
        newer_steps: str,
        incremental: bool = False,
        chunk_bytes: int | None = None,
        group: Group | None = None,
    ) -> None:
        self.conn = conn
        self.group = group
        self._root = (root, storage_options)
        self.newest: int | None = None
        self.loop_thread: int | None = None
        self.failures = Failures()
        self.max_pending = max_pending
        self._slots = threading.BoundedSemaphore(max_pending)
        self._lock = threading.Lock()
        self._saves: dict[int, SaveHandle] = {}
        self._early: dict[int, p.Committed | p.Failed] = {}  # resolved before registered
        self._attempts: dict[int, int] = {}  # save -> its attempt number (many ranks)
        self._stopped: anyio.Event | None = None
        self._mappings = _Mappings()
        conn.on_event = self._event
        conn.on_lost = self._lost
        reply, _ = conn.request(
            p.OpenWriter,
            root=root,
            storage_options=storage_options,
            keep_last=policy.keep_last,
            keep_every=policy.keep_every,
            keep_best=policy.keep_best,
            best_metric=policy.best_metric,
            best_mode=policy.best_mode,
            max_pending=max_pending,
            max_concurrency=max_concurrency,
            newer_steps=newer_steps,
            incremental=incremental,
            chunk_bytes=chunk_bytes,
            group=None if group is None else group.hosted,
        )
        assert isinstance(reply, p.WriterOpened)
        self.writer = reply.writer

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self._stopped = anyio.Event()
        task_status.started()
        await self._stopped.wait()

    async def stop(self) -> None:
        """Wait until every accepted save resolved, then end ``run``."""
        # Handles resolve on the connection's reader thread: polled, cancellable.
        while True:
            with self._lock:
                pending = [h for h in self._saves.values() if not h.done()]
            if not pending:
                break
            await anyio.sleep(0.01)
        assert self._stopped is not None
        self._stopped.set()

    async def acquire_buffer(self) -> StagingBuffer:
        # Slots are given back by the connection's reader thread: polled, so that the
        # wait stays cancellable (an interrupted save()).
        while not self._slots.acquire(blocking=False):  # noqa: ASYNC110
            await anyio.sleep(0.002)
        return _SegmentBuffer(self.conn, self._mappings)

    def release_buffer(self, buffer: StagingBuffer) -> None:
        """Give back a buffer whose save was never submitted (its capture failed)."""
        assert isinstance(buffer, _SegmentBuffer)
        segment = buffer.segment
        buffer.forget()
        self._slots.release()
        if segment is not None and self.conn.lost is None:
            with contextlib.suppress(ServiceError):  # gone: its memory went with it
                self.conn.request(p.Free, segment=segment)

    async def submit(self, snapshot: Snapshot, handle: SaveHandle) -> None:
        """Hand the snapshot to the service; returns once it is accepted (it commits
        from now on, whatever happens to this process)."""
        buffer = snapshot.buffer
        assert isinstance(buffer, _SegmentBuffer)
        try:
            desc = describe(snapshot)
            segment = buffer.segment
            assert segment is not None
            reply, _ = await anyio.to_thread.run_sync(
                lambda: self.conn.request(
                    p.Submit, writer=self.writer, segment=segment, snapshot=desc
                )
            )
        except BaseException:
            self.release_buffer(buffer)
            raise
        assert isinstance(reply, p.Accepted)
        buffer.forget()
        with self._lock:
            early = self._early.pop(reply.save, None)
            lost = self.conn.lost if early is None else None
            if early is None and lost is None:
                self._saves[reply.save] = handle
                self._attempts[reply.save] = snapshot.attempt
        if early is not None:
            self._outcome(handle, early)
        elif lost is not None:
            self._after_loss(handle, snapshot.attempt, lost)

    def _resolve(self, handle: SaveHandle, info: Any, error: BaseException | None) -> None:
        if handle.done():
            return
        if error is not None:
            self.failures.add(error)
        handle.resolve(info, error)
        self._slots.release()

    def _event(self, message: p.Message) -> None:
        """Reader thread: a save resolved, or a background error to report."""
        if isinstance(message, p.Notice):
            self.failures.add(error_from(message.error, message.message))
            return
        assert isinstance(message, p.Committed | p.Failed)
        with self._lock:
            handle = self._saves.pop(message.save, None)
            self._attempts.pop(message.save, None)
            if handle is None:
                self._early[message.save] = message  # its submit has not registered it yet
                return
        self._outcome(handle, message)

    def _outcome(self, handle: SaveHandle, message: p.Committed | p.Failed) -> None:
        if isinstance(message, p.Committed):
            info = message.info
            self.newest = max(info.step, -1 if self.newest is None else self.newest)
            self._resolve(handle, info, None)
        else:
            self._resolve(handle, None, error_from(message.error, message.message))

    def _lost(self, error: ServiceError) -> None:
        """Reader thread: the service went away; every pending save fails."""
        with self._lock:
            saves, self._saves = self._saves, {}
            attempts, self._attempts = self._attempts, {}
        for save, handle in saves.items():
            self._after_loss(handle, attempts.get(save, 0), error)

    def _after_loss(self, handle: SaveHandle, attempt: int, error: ServiceError) -> None:
        """Resolve a save the service did not report on. Alone: it failed (nothing of it
        is visible). With many ranks this rank follows the attempt's one outcome (the
        others may have committed it): in a thread of its own, as it may wait."""
        if self.group is None:
            self._resolve(
                handle,
                None,
                ServiceError(
                    f"{error}; the save of step {handle.step} did not finish there (nothing "
                    "of it is visible; gc removes what it left)"
                ),
            )
            return
        group, (root, options) = self.group, self._root

        def follow() -> None:
            from .follow import outcome_after_loss

            info, failure = outcome_after_loss(group, root, options, handle.step, attempt, error)
            self._resolve(handle, info, failure)

        threading.Thread(target=follow, name="checkpointd-follow", daemon=True).start()

    def close_store(self) -> None:
        self.conn.close()
        self._mappings.close()
        if self.group is not None:
            self.group.close()  # other ranks now know this rank's writer is gone

    def take_unseen_error(self) -> BaseException | None:
        return self.failures.take_first()
