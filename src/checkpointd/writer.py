"""The checkpoint writer service: sync and async front ends over one background write loop.

``save()`` captures the state on the caller's thread and queues the snapshot;
a service task on an anyio event loop writes queued snapshots one at a time, in
order, each with its files written concurrently. ``CheckpointWriter`` runs that
loop in a thread of its own; ``AsyncCheckpointWriter`` runs it in the caller's
loop (asyncio or trio). At most ``max_pending`` snapshots exist at once (one
staging buffer each, reused across saves): ``save()`` waits for a free one.

A failed save resolves its handle with the error; an error nobody has seen yet
is raised again by ``wait()``, by the next ``save()``, and when the writer closes.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Literal

import anyio
import anyio.to_thread
import msgspec
import numpy as np
import torch
from anyio.abc import TaskGroup, TaskStatus
from anyio.from_thread import BlockingPortal, start_blocking_portal
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from checkpointd.capture import StagingBuffer, capture
from checkpointd.commit import Snapshot, apply_retention, write_snapshot
from checkpointd.errors import (
    CheckpointError,
    CheckpointExistsError,
    UnsupportedValueError,
    WriterClosedError,
)
from checkpointd.manifest import CheckpointInfo
from checkpointd.retention import RetentionPolicy, WriterIdentity
from checkpointd.storage import Store, open_store

__all__ = ["AsyncCheckpointWriter", "CheckpointWriter", "SaveHandle"]

MAX_STEP = 10**12 - 1


class SaveHandle:
    """The outcome of one ``save()``: resolved by the writer once the checkpoint is
    committed (or failed). ``result()`` may be called from any thread; ``wait()``
    from any event loop."""

    def __init__(self, step: int, started: float, event: anyio.Event | None = None) -> None:
        self.step = step
        self.blocked_seconds = 0.0
        """Seconds ``save()`` held the caller (waiting for a buffer plus capture)."""
        self.durable_seconds: float | None = None
        """Seconds from the call to ``save()`` until committed; None until done."""
        self._started = started
        self._event = event
        self._done = threading.Event()
        self._info: CheckpointInfo | None = None
        self._error: BaseException | None = None
        self._failures: _Failures | None = None

    def done(self) -> bool:
        """True once the save is committed or has failed."""
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> CheckpointInfo:
        """Block until the save resolves; return its CheckpointInfo or raise its error.

        Raises TimeoutError if it is still running after ``timeout`` seconds.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"save of step {self.step} still running after {timeout}s")
        return self._outcome()

    async def wait(self) -> CheckpointInfo:
        """Await the save's resolution; return its CheckpointInfo or raise its error."""
        if not self._done.is_set():
            if self._event is not None:
                await self._event.wait()
            else:
                await anyio.to_thread.run_sync(self._done.wait, abandon_on_cancel=True)
        return self._outcome()

    def _outcome(self) -> CheckpointInfo:
        if self._error is not None:
            if self._failures is not None:
                self._failures.observe(self._error)
            raise self._error
        assert self._info is not None
        return self._info

    def _resolve(self, info: CheckpointInfo | None, error: BaseException | None) -> None:
        """Called once, on the writer's event loop."""
        self._info, self._error = info, error
        self.durable_seconds = time.perf_counter() - self._started
        self._done.set()
        if self._event is not None:
            self._event.set()

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error else "committed")
        return f"<SaveHandle step={self.step} {state}>"


class _Failures:
    """Errors from the background that nobody has seen raised yet. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._unseen: list[BaseException] = []

    def add(self, error: BaseException) -> None:
        with self._lock:
            self._unseen.append(error)

    def observe(self, error: BaseException) -> None:
        with self._lock:
            self._unseen = [e for e in self._unseen if e is not error]

    def raise_first(self) -> None:
        """Raise the oldest unseen error (marking it seen), if any."""
        with self._lock:
            if not self._unseen:
                return
            error = self._unseen.pop(0)
        raise error


def _first_leaf(error: BaseException) -> BaseException:
    """The first concrete error inside (possibly nested) exception groups."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


class _WriteService:
    """The background half: lives on one event loop and writes snapshots in order."""

    def __init__(
        self, store: Store, policy: RetentionPolicy, max_pending: int, max_concurrency: int
    ) -> None:
        self.store = store
        self.policy = policy
        self.identity = WriterIdentity()  # recorded in its manifests; see retention
        self.max_pending = max_pending
        self.max_concurrency = max_concurrency
        self.failures = _Failures()
        self._buffers = [StagingBuffer() for _ in range(max_pending)]
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
        """Write one snapshot, run retention, then resolve its handle (in that order)."""
        try:
            try:
                info = await write_snapshot(self.store, snapshot, limiter, identity=self.identity)
            finally:
                self.release_buffer(snapshot.buffer)  # the next save may capture now
        except Exception as exc:
            error = _first_leaf(exc)
            self.failures.add(error)
            handle._resolve(None, error)
            return
        except BaseException:
            handle._resolve(None, WriterClosedError("the writer stopped during this save"))
            raise
        try:
            await apply_retention(
                self.store, self.policy, limiter, committed_step=info.step, identity=self.identity
            )
        except Exception as exc:
            # The checkpoint is committed; the retention failure is reported on its own.
            self.failures.add(_first_leaf(exc))
        finally:
            handle._resolve(info, None)

    async def acquire_buffer(self) -> StagingBuffer:
        """Wait for a free staging buffer (at most ``max_pending`` saves exist at once)."""
        assert self._free is not None
        return await self._free[1].receive()

    def release_buffer(self, buffer: StagingBuffer) -> None:
        """Return a buffer to the pool; on the event loop."""
        assert self._free is not None
        self._free[0].send_nowait(buffer)

    async def submit(self, snapshot: Snapshot, handle: SaveHandle) -> None:
        """Queue a captured snapshot; never blocks (the queue holds max_pending)."""
        assert self._queue is not None
        handle._failures = self.failures
        await self._queue[0].send((snapshot, handle))

    async def stop(self) -> None:
        """Let queued saves finish, then end ``run``."""
        if self._queue is not None:
            await self._queue[0].aclose()


class _WriterBase:
    """What both front ends share: options, validation, pending handles, error surfacing.

    Options: ``root`` is a local path or fsspec URL (``storage_options`` reach it);
    ``keep_last``/``keep_every``/``keep_best`` with ``best_metric``/``best_mode`` are
    the retention rules (see RetentionPolicy); ``max_pending`` snapshots may exist
    at once (each one staging buffer, reused); ``max_concurrency`` files of a save
    are written at once; ``background_niceness`` (Linux, CheckpointWriter only)
    lowers the CPU priority of the writer's threads, so training steps keep the
    cores while a save is in flight and the save takes longer.
    """

    def __init__(
        self,
        root: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: Literal["min", "max"] = "min",
        max_pending: int = 1,
        max_concurrency: int = 4,
        background_niceness: int = 0,
    ) -> None:
        for name, value in (("max_pending", max_pending), ("max_concurrency", max_concurrency)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, not {value!r}")
        if isinstance(background_niceness, bool) or background_niceness not in range(20):
            raise ValueError(
                f"background_niceness must be an int from 0 to 19, not {background_niceness!r}"
            )
        if background_niceness and not sys.platform.startswith("linux"):
            raise ValueError("background_niceness needs Linux (per-thread priorities)")
        self.background_niceness = background_niceness
        self.root = str(root)
        self.policy = RetentionPolicy(keep_last, keep_every, keep_best, best_metric, best_mode)
        self._store = open_store(self.root, storage_options)
        self._service = _WriteService(self._store, self.policy, max_pending, max_concurrency)
        self._pending: list[SaveHandle] = []
        self._closed = False
        self._start()

    def _start(self) -> None:
        """Start the write service where the front end runs it; last step of __init__."""

    def _before_save(self, step: int) -> None:
        """Checks on the caller thread, before anything is captured."""
        if self._closed:
            raise WriterClosedError("this writer is closed; create a new one")
        self._service.failures.raise_first()
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
            raise ValueError(f"step must be an int from 0 to {MAX_STEP}, not {step!r}")
        self._pending = [h for h in self._pending if not h.done()]
        if any(h.step == step for h in self._pending):
            raise CheckpointExistsError(f"a save of step {step} is already in progress")

    def _snapshot(
        self,
        step: int,
        state: Mapping[str, Any],
        buffer: StagingBuffer,
        metrics: Mapping[str, Any] | None,
        metadata: Mapping[str, Any] | None,
    ) -> Snapshot:
        created_at = datetime.now(UTC)
        plain_metrics = _plain_json(metrics, "metrics")
        plain_metadata = _plain_json(metadata, "metadata")
        components = capture(state, buffer)
        return Snapshot(step, components, buffer, created_at, plain_metrics, plain_metadata)

    def _track(self, handle: SaveHandle) -> SaveHandle:
        handle.blocked_seconds = time.perf_counter() - handle._started
        self._pending.append(handle)
        return handle


def _json_hook(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, np.generic):
        return value.item()
    raise UnsupportedValueError(f"{type(value).__qualname__} is not JSON-able")


def _plain_json(value: Mapping[str, Any] | None, what: str) -> dict[str, Any]:
    """A plain-JSON copy of ``value``: scalar tensors and NumPy scalars become numbers,
    NaN and infinities become null (JSON has neither)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise UnsupportedValueError(f"{what} must be a mapping with str keys")
    try:
        plain: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(value, enc_hook=_json_hook))
    except (UnsupportedValueError, TypeError, OverflowError, msgspec.EncodeError) as exc:
        raise UnsupportedValueError(f"{what} must be JSON-able: {exc}") from exc
    return plain


_LIVE_WRITERS: weakref.WeakSet[CheckpointWriter] = weakref.WeakSet()
_exit_hook_lock = threading.Lock()
_exit_hook_registered = False


def _close_live_writers() -> None:
    """At interpreter exit, finish the pending saves of writers nobody closed.

    Runs before non-daemon threads are joined (the service thread is one); an
    error nobody saw is printed, since there is no caller left to raise it to.
    """
    for writer in list(_LIVE_WRITERS):
        try:
            writer.close()
        except Exception as exc:
            print(f"checkpointd: unclosed writer for {writer.root}: {exc}", file=sys.stderr)


def _register_exit_hook() -> None:
    global _exit_hook_registered
    with _exit_hook_lock:
        if _exit_hook_registered:
            return
        # threading's own pre-join hook (what concurrent.futures uses): plain atexit
        # runs only after non-daemon threads are joined, which would wait forever.
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(_close_live_writers)
        _exit_hook_registered = True


def _lower_thread_priority(niceness: int) -> None:
    """Set the calling thread's niceness (Linux: PRIO_PROCESS with a thread id is per thread)."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)


class CheckpointWriter(_WriterBase, AbstractContextManager["CheckpointWriter"]):
    """Saves checkpoints in the background from synchronous training code.

    Use as a context manager (or call ``close()``). ``save`` and ``wait`` are
    called from one training thread; handles may be waited on from any thread.
    """

    def _start(self) -> None:
        """Run the service on an event loop in a thread of its own."""
        self._portal_cm = start_blocking_portal(backend="asyncio")
        self._portal: BlockingPortal = self._portal_cm.__enter__()
        try:
            if self.background_niceness:
                # Worker threads are spawned by the loop's thread and inherit its niceness.
                self._portal.call(_lower_thread_priority, self.background_niceness)
            self._service_done, _ = self._portal.start_task(self._service.run)
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        _register_exit_hook()
        _LIVE_WRITERS.add(self)

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> SaveHandle:
        """Snapshot ``state`` for ``step`` and write it in the background.

        Returns once the snapshot is taken: the caller may change its tensors.
        Blocks first while ``max_pending`` saves are in flight. Raises at once for
        a bad step or an unstorable value, and raises a background error not yet seen.
        """
        started = time.perf_counter()
        self._before_save(step)
        buffer = self._portal.call(self._service.acquire_buffer)
        try:
            snapshot = self._snapshot(step, state, buffer, metrics, metadata)
        except BaseException:
            self._portal.call(self._service.release_buffer, buffer)
            raise
        handle = SaveHandle(step, started)
        self._portal.call(self._service.submit, snapshot, handle)
        return self._track(handle)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending save is resolved; raise the first error not yet seen.

        Raises TimeoutError if saves are still running after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        for handle in list(self._pending):
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not handle._done.wait(remaining):
                raise TimeoutError(f"saves still running after {timeout}s")
        self._pending.clear()
        self._service.failures.raise_first()

    def close(self) -> None:
        """Wait for pending saves, stop the service, then raise an error not yet seen."""
        if self._closed:
            return
        self._closed = True
        _LIVE_WRITERS.discard(self)
        try:
            self._portal.call(self._service.stop)
            self._service_done.result()
        finally:
            self._portal_cm.__exit__(None, None, None)
            self._store.close()
        self._pending.clear()
        self._service.failures.raise_first()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.close()
        except CheckpointError:
            if exc is None:
                raise  # otherwise the body's exception is the one to report


class AsyncCheckpointWriter(_WriterBase):
    """Saves checkpoints in the background from async training code (asyncio or trio).

    Use with ``async with``; the write service runs as a task in the caller's loop
    and its blocking I/O in worker threads. Call ``save``/``wait`` from that loop.
    """

    _group: TaskGroup | None = None

    async def __aenter__(self) -> AsyncCheckpointWriter:
        if self.background_niceness:
            raise ValueError(
                "background_niceness is for CheckpointWriter: these threads are your loop's"
            )
        if self._group is not None or self._closed:
            raise WriterClosedError("an AsyncCheckpointWriter can be entered once")
        group = anyio.create_task_group()
        await group.__aenter__()
        self._group = group
        await group.start(self._service.run)
        return self

    async def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> SaveHandle:
        """Snapshot ``state`` for ``step`` (on the loop's thread) and write it in the background.

        Returns once the snapshot is taken; see ``CheckpointWriter.save``.
        """
        started = time.perf_counter()
        if self._group is None:
            raise WriterClosedError("use the writer inside 'async with'")
        self._before_save(step)
        buffer = await self._service.acquire_buffer()
        try:
            snapshot = self._snapshot(step, state, buffer, metrics, metadata)
        except BaseException:
            self._service.release_buffer(buffer)
            raise
        handle = SaveHandle(step, started, anyio.Event())
        await self._service.submit(snapshot, handle)
        return self._track(handle)

    async def _drain(self) -> None:
        for handle in list(self._pending):
            if not handle.done():
                assert handle._event is not None
                await handle._event.wait()
        self._pending.clear()

    async def wait(self) -> None:
        """Wait until every pending save is resolved; raise the first error not yet seen."""
        await self._drain()
        self._service.failures.raise_first()

    async def aclose(self) -> None:
        """Wait for pending saves, stop the service, then raise an error not yet seen."""
        if self._closed or self._group is None:
            self._closed = True
            return
        self._closed = True
        group, self._group = self._group, None
        try:
            await self._drain()
        finally:
            await self._service.stop()
            await group.__aexit__(None, None, None)
            self._store.close()
        self._service.failures.raise_first()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self.aclose()
        except CheckpointError:
            if exc is None:
                raise
