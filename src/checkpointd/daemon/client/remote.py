"""The service backend: a writer's saves made durable by the checkpoint service.

``CheckpointWriter(root, service=...)`` runs a ``ServiceBackend`` where it would
run the in-process one (both are ``write/backend.WriteBackend``s). ``save()`` works as always: a staging buffer
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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import msgspec
from anyio.abc import TaskStatus

from checkpointd.daemon.client.client import Connection, connect, error_from
from checkpointd.daemon.client.peering import join_peers
from checkpointd.daemon.client.segments import Mappings, SegmentBuffer
from checkpointd.daemon.wire import protocol as p
from checkpointd.daemon.wire.snapshot import describe
from checkpointd.errors import InvalidArgumentError, ServiceError, StagingError
from checkpointd.write.capture import StagingBuffer
from checkpointd.write.handle import Failures, SaveHandle
from checkpointd.write.options import SaveTarget, WriterOptions
from checkpointd.write.plan import Snapshot

if TYPE_CHECKING:
    from checkpointd.ranks.group import Group
    from checkpointd.write.incremental import CaptureHold

__all__ = ["ServiceBackend", "open_remote"]


def open_remote(target: SaveTarget, options: WriterOptions, group: Group | None) -> ServiceBackend:
    """The ServiceBackend of a writer of ``target`` made with ``service=`` (in ``options``);
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
    storage_options = target.storage_options
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
        backend = ServiceBackend(conn, target, options, storage_options=plain, group=group)
        if options.replicas and group is not None:  # every rank: a collective on the store
            join_peers(conn, group, target.root, plain, options.replicas)
        return backend
    except BaseException:
        conn.close()
        raise


class ServiceBackend:
    """The ``WriteBackend`` of a writer with ``service=``: the service plans and commits.

    ``acquire_buffer``/``release_buffer``/``submit`` are called on the writer's loop
    thread as with the in-process backend; handles are resolved by the connection's
    reader thread (a sync writer's handles are thread-safe). With ``incremental=True``
    the service's writer references unchanged tensors (the same files as in-process);
    the capture here copies every tensor (``hold_unchanged`` is None: a hash instead of
    a copy needs the saver's state, which is the service's)."""

    loop_thread: int | None = None
    """None: handles are resolved on the connection's reader thread."""

    def __init__(
        self,
        conn: Connection,
        target: SaveTarget,
        options: WriterOptions,
        *,
        storage_options: dict[str, Any] | None,
        group: Group | None = None,
    ) -> None:
        """Open a writer of ``target`` in the service with ``options`` (``storage_options``:
        the target's made JSON-able): the root, storage options and layout are sent once,
        here."""
        self.conn = conn
        self.group = group
        self._root = (target.root, storage_options)
        self.newest: int | None = None
        self.failures = Failures()
        self.max_pending = options.max_pending
        self._lock = threading.Lock()
        self._saves: dict[int, SaveHandle] = {}
        self._sent: dict[int, tuple[SaveHandle, int]] = {}  # Submit id -> handle, attempt
        self._attempts: dict[int, int] = {}  # save -> its attempt number (many ranks)
        self._stopped: anyio.Event | None = None
        self._changed = threading.Condition()  # guards the two below; notified on change
        self._free = options.max_pending  # staging buffers not taken (slots)
        self._staging: set[SaveHandle] = set()  # overlapped saves not yet handed over
        self._mappings = Mappings()
        self._ahead: int | None = None  # bytes the last capture reserved: asked for ahead
        conn.on_event = self._event
        conn.on_lost = self._lost
        policy = options.policy
        reply, _ = conn.request(
            p.OpenWriter,
            root=target.root,
            storage_options=storage_options,
            layout=target.layout,
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
        """Wait for ``stop``: the saves themselves run in the service."""
        self._stopped = anyio.Event()
        task_status.started()
        await self._stopped.wait()

    async def stop(self) -> None:
        """Wait until every overlapped save still copying was handed over and every
        accepted save resolved (every buffer given back), then end ``run`` (the
        connection and the mappings the copies write into stay open until then)."""
        await self._when(lambda: self._free == self.max_pending and not self._staging)
        assert self._stopped is not None
        self._stopped.set()

    async def acquire_buffer(self) -> StagingBuffer:
        """A segment buffer, once fewer than ``max_pending`` saves hold one (buffers are
        given back as saves resolve, on the connection's reader thread)."""

        def take() -> None:
            self._free -= 1

        await self._when(lambda: self._free > 0, take, undo=self._give_slot)
        try:
            return SegmentBuffer(self.conn, self._mappings, ahead=self._ahead)
        except BaseException:  # the service is gone: no save holds this slot
            self._give_slot()
            raise

    async def _when(
        self,
        ready: Callable[[], bool],
        then: Callable[[], None] = lambda: None,
        *,
        undo: Callable[[], None] = lambda: None,
    ) -> None:
        """Wait until ``ready()`` holds, then ``then()`` (both under ``_changed``). The
        wait blocks a worker thread on the condition, woken by each change; cancelled,
        it ends that wait, and ``undo()``s a ``then()`` that ran anyway."""
        with self._changed:
            if ready():
                then()
                return
        abandoned, done = [False], [False]

        def wait() -> None:
            with self._changed:
                self._changed.wait_for(lambda: abandoned[0] or ready())
                if not abandoned[0]:
                    then()
                    done[0] = True

        try:
            await anyio.to_thread.run_sync(wait, abandon_on_cancel=True)
        except BaseException:
            with self._changed:
                abandoned[0] = True
                self._changed.notify_all()
                ran = done[0]
            if ran:
                undo()
            raise

    def _give_slot(self) -> None:
        with self._changed:
            self._free += 1
            self._changed.notify_all()

    def hold_unchanged(self) -> CaptureHold | None:
        """None: capture copies every tensor (the service finds unchanged ones)."""
        return None

    def release_buffer(self, buffer: StagingBuffer) -> None:
        """Give back a buffer whose save was never submitted (its capture failed)."""
        assert isinstance(buffer, SegmentBuffer)
        segment = buffer.segment
        try:
            buffer.cancel_ahead()
            buffer.forget()
        finally:
            self._give_slot()
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
        with self._changed:
            self._staging.add(handle)
        if staging is not None and staging.hand_over(
            lambda error: self._hand_over(snapshot, handle, error)
        ):
            return
        self._handed(handle)
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
                try:
                    self._abandon(snapshot, error)
                finally:
                    self.release_buffer(snapshot.buffer)
                raise error
            self._send(snapshot, handle)  # gives the buffer back if it raises
        except Exception as exc:
            self.failures.add(exc)
            handle.resolve(None, exc)
        finally:
            self._handed(handle)

    def _handed(self, handle: SaveHandle) -> None:
        with self._changed:
            self._staging.discard(handle)
            self._changed.notify_all()

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
        self._give_slot()

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
            from checkpointd.daemon.client.follow import outcome_after_loss

            info, failure = outcome_after_loss(group, root, options, handle.step, attempt, error)
            self._resolve(handle, info, failure)

        threading.Thread(target=follow, name="checkpointd-follow", daemon=True).start()

    def close_store(self) -> None:
        """Close the connection and the mappings; leave the group (many ranks)."""
        self.conn.close()
        self._mappings.close()
        if self.group is not None:
            self.group.close()  # other ranks now know this rank's writer is gone

    def take_unseen_error(self) -> BaseException | None:
        """The oldest error nobody has seen raised, marked seen (for the exit report)."""
        return self.failures.take_first()
