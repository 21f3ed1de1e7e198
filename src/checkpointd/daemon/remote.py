"""The writer's side of a save through the service: a stand-in for ``WriteService``.

``CheckpointWriter(root, service=...)`` runs a ``RemoteService`` where it would
run its in-process write service. ``save()`` works as always: a staging buffer
is acquired (at most ``max_pending`` saves in flight), the state is captured by
today's capture code into it (the buffer's arena is a fresh segment of the
service's shared memory, asked for at the size capture needs), then ``submit``
sends the snapshot's description and returns once
it is in the service's socket queue (no round trip: the service reads what a
dead client sent): from then on the checkpoint commits even if this process
dies. The handle resolves when the service reports the commit or the failure;
if the service goes away, every pending handle fails with ServiceError at once.

With ``staging="overlapped"`` the copy may still run when ``save()`` returns: the
snapshot is sent when it ends, before the save counts as staged, so the service
owns it from ``handle.staged()`` on, not from the return. Handles are
resolved by the connection's reader thread, never on an event loop, so an
AsyncCheckpointWriter awaits them through a worker thread. Imports torch.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import msgspec
from anyio.abc import TaskStatus

from checkpointd.errors import InvalidArgumentError, ServiceError, StagingError
from checkpointd.write.capture import StagingBuffer
from checkpointd.write.handle import Failures, SaveHandle
from checkpointd.write.options import WriterOptions
from checkpointd.write.plan import Snapshot

from . import protocol as p
from .client import Connection, connect, error_from
from .segments import Mappings, SegmentBuffer
from .snapshot import describe

if TYPE_CHECKING:
    from checkpointd.ranks.group import Group

__all__ = ["RemoteService", "open_remote"]


def open_remote(root: str, options: WriterOptions, group: Group | None) -> RemoteService:
    """The RemoteService of a writer of ``root`` made with ``service=`` (in ``options``);
    ``group``: the ranks it saves with, re-keyed for the service (ranks/hosted.py), or
    None. InvalidArgumentError for a ``buffer_pool`` (the service's shared memory is
    the buffers), ServiceError if no service answers (or, with "auto", none could be
    started)."""
    if options.buffer_pool is not None:
        raise InvalidArgumentError(
            "the checkpoint service does not take a buffer_pool (its shared memory is "
            "the staging buffers): use service=None for this writer"
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
        return RemoteService(conn, root, options, storage_options=plain, group=group)
    except BaseException:
        conn.close()
        raise


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
        options: WriterOptions,
        *,
        storage_options: dict[str, Any] | None,
        group: Group | None = None,
    ) -> None:
        """Open a writer of ``root`` in the service with ``options`` (``storage_options``:
        theirs made JSON-able)."""
        self.conn = conn
        self.group = group
        self._root = (root, storage_options)
        self.newest: int | None = None
        self.loop_thread: int | None = None
        self.failures = Failures()
        self.max_pending = options.max_pending
        self._slots = threading.BoundedSemaphore(options.max_pending)
        self._lock = threading.Lock()
        self._saves: dict[int, SaveHandle] = {}
        self._sent: dict[int, tuple[SaveHandle, int]] = {}  # Submit id -> handle, attempt
        self._attempts: dict[int, int] = {}  # save -> its attempt number (many ranks)
        self._stopped: anyio.Event | None = None
        self._staging: set[SaveHandle] = set()  # overlapped saves not yet handed over
        self._mappings = Mappings()
        self._ahead: int | None = None  # bytes the last capture reserved: asked for ahead
        conn.on_event = self._event
        conn.on_lost = self._lost
        policy = options.policy
        reply, _ = conn.request(
            p.OpenWriter,
            root=root,
            storage_options=storage_options,
            keep_last=policy.keep_last,
            keep_every=policy.keep_every,
            keep_best=policy.keep_best,
            best_metric=policy.best_metric,
            best_mode=policy.best_mode,
            max_pending=options.max_pending,
            max_concurrency=options.max_concurrency,
            newer_steps=options.newer_steps,
            incremental=options.incremental,
            chunk_bytes=options.chunk_bytes,
            group=None if group is None else group.hosted,
        )
        assert isinstance(reply, p.WriterOpened)
        self.writer = reply.writer

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self._stopped = anyio.Event()
        task_status.started()
        await self._stopped.wait()

    async def stop(self) -> None:
        """Wait until every overlapped save still copying was handed over and every
        accepted save resolved, then end ``run`` (the connection and the mappings the
        copies write into stay open until then)."""
        # Handles resolve on the connection's reader thread: polled, cancellable.
        while True:
            with self._lock:
                pending = [h for h in self._saves.values() if not h.done()]
                pending += [h for h, _ in self._sent.values() if not h.done()]
                pending += self._staging
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
        return SegmentBuffer(self.conn, self._mappings, ahead=self._ahead)

    def release_buffer(self, buffer: StagingBuffer) -> None:
        """Give back a buffer whose save was never submitted (its capture failed)."""
        assert isinstance(buffer, SegmentBuffer)
        segment = buffer.segment
        buffer.cancel_ahead()
        buffer.forget()
        self._slots.release()
        if segment is not None and self.conn.lost is None:
            with contextlib.suppress(ServiceError):  # gone: its memory went with it
                self.conn.request(p.Free, segment=segment)

    async def submit(self, snapshot: Snapshot, handle: SaveHandle) -> None:
        """Hand the snapshot to the service; returns once its description is in the
        service's socket queue (it commits from now on, whatever happens to this
        process: the service reads what a dead client sent). An overlapped save whose
        copy still runs is handed over by the copier's thread when the copy ends, before
        the save counts as staged (saves stage one at a time, so they are sent in
        order); then this returns at once."""
        staging = handle.staging
        with self._lock:
            self._staging.add(handle)
        if staging is not None and staging.hand_over(
            lambda error: self._hand_over(snapshot, handle, error)
        ):
            return
        with self._lock:
            self._staging.discard(handle)
        if staging is None:
            self._send(snapshot, handle)  # no round trip: a send, on the loop thread
        else:  # the copy has already ended: as at its end
            await anyio.to_thread.run_sync(self._hand_over, snapshot, handle, staging.error)

    def _hand_over(
        self, snapshot: Snapshot, handle: SaveHandle, error: StagingError | None
    ) -> None:
        """Copier thread, at the end of an overlapped save's copy: send it, or fail its
        handle (a failed copy; the service unreachable)."""
        try:
            if error is not None:
                self._abandon(snapshot, error)
                self.release_buffer(snapshot.buffer)
                raise error
            self._send(snapshot, handle)  # gives the buffer back if it raises
        except Exception as exc:
            self.failures.add(exc)
            handle.resolve(None, exc)
        finally:
            with self._lock:
                self._staging.discard(handle)

    def _abandon(self, snapshot: Snapshot, error: StagingError) -> None:
        """With ranks, a failed copy abandons the attempt on every rank (they fail at once)."""
        if self.group is not None:
            from checkpointd.ranks.attempt import abandon

            abandon(self.group, snapshot.step, snapshot.attempt, f"its staging failed ({error})")

    def _send(self, snapshot: Snapshot, handle: SaveHandle) -> None:
        """Send one save's description, its handle registered under the request's id
        (the service's ``Accepted`` reply, read before that save's outcome, files it by
        save); gives the buffer back if it raises. Any thread; it waits only while the
        service's socket queue is full (a description larger than that queue)."""
        buffer = snapshot.buffer
        assert isinstance(buffer, SegmentBuffer)
        ident = None
        try:
            desc = describe(snapshot)
            segment = buffer.segment
            assert segment is not None
            ident = self.conn.new_id()
            frame = p.encode(p.Submit(ident, self.writer, segment, desc))
            with self._lock:
                self._sent[ident] = (handle, snapshot.attempt)
            self.conn.post(ident, frame)
            self._ahead = buffer.nbytes
        except BaseException:
            with self._lock:
                ours = ident is None or self._sent.pop(ident, None) is not None
            if ours:
                self.release_buffer(buffer)
            else:  # the loss of the service resolved the handle and gave its slot back
                buffer.forget()
            raise
        buffer.forget()

    def _resolve(self, handle: SaveHandle, info: Any, error: BaseException | None) -> None:
        if handle.done():
            return
        if error is not None:
            self.failures.add(error)
        handle.resolve(info, error)
        self._slots.release()

    def _event(self, message: p.Message) -> None:
        """Reader thread: a save accepted or refused, a save resolved, or a background
        error to report."""
        if isinstance(message, p.Notice):
            self.failures.add(error_from(message.error, message.message))
            return
        if isinstance(message, p.Ok):  # a segment given back (SegmentBuffer.cancel_ahead)
            return
        if isinstance(message, p.Accepted | p.Error):
            with self._lock:
                sent = self._sent.pop(message.id, None)
                if sent is None:
                    return
                handle, attempt = sent
                if isinstance(message, p.Accepted):
                    self._saves[message.save] = handle
                    self._attempts[message.save] = attempt
            if isinstance(message, p.Error):
                self._resolve(handle, None, error_from(message.error, message.message))
            return
        assert isinstance(message, p.Committed | p.Failed)
        with self._lock:
            resolved = self._saves.pop(message.save, None)
            self._attempts.pop(message.save, None)
        if resolved is not None:  # (None: resolved already, as the service went away)
            self._outcome(resolved, message)

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
            sent, self._sent = self._sent, {}
        for save, handle in saves.items():
            self._after_loss(handle, attempts.get(save, 0), error)
        for handle, attempt in sent.values():
            self._after_loss(handle, attempt, error)

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
