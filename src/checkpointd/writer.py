"""The checkpoint writer: sync and async front ends over one background write service.

``save()`` captures the state on the caller's thread and queues the snapshot;
the service (service.py) writes queued snapshots one at a time, in order, each
with its files written concurrently. ``CheckpointWriter`` runs the service on an
event loop in a thread of its own (lifecycle.py); ``AsyncCheckpointWriter`` runs
it in the caller's loop (asyncio or trio). At most ``max_pending`` snapshots
exist at once (one staging buffer each, reused across saves): ``save()`` waits
for a free one.

A failed save resolves its handle with the error; an error nobody has seen yet
is raised again by ``wait()``, by the next ``save()``, and when the writer closes.
"""

from __future__ import annotations

import errno
import os
import sys
import time
import weakref
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Literal

import anyio
import anyio.to_thread
import msgspec
import numpy as np
import torch
from anyio.abc import TaskGroup

from checkpointd import lifecycle
from checkpointd.capture import StagingBuffer, capture
from checkpointd.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointTimeoutError,
    InvalidArgumentError,
    StepOrderError,
    StorageError,
    UnsupportedValueError,
    WriterClosedError,
)
from checkpointd.handle import SaveHandle
from checkpointd.layout import MAX_STEP, is_step
from checkpointd.lifecycle import LoopThread
from checkpointd.manifest import CheckpointInfo, too_deep
from checkpointd.plan import Snapshot
from checkpointd.restore import Checkpoint, RestoreInfo, list_checkpoints, load, restore
from checkpointd.retention import RetentionPolicy
from checkpointd.service import NewerSteps, WriteService, newest_committed
from checkpointd.storage import LocalStore, open_store
from checkpointd.tunables import (
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_MAX_PENDING,
    MAX_JSON_DEPTH,
    MAX_METADATA_BYTES,
)

__all__ = ["AsyncCheckpointWriter", "CheckpointWriter", "SaveHandle"]

_NEWER_STEPS = ("error", "keep", "discard")


class _WriterBase:
    """What both front ends share: options, validation, pending handles, error surfacing.

    Options: ``root`` is a local path or fsspec URL (``storage_options`` reach it);
    ``keep_last``/``keep_every``/``keep_best`` with ``best_metric``/``best_mode`` are
    the retention rules (see RetentionPolicy), or pass ``retention=RetentionPolicy(...)``
    instead (not both); ``max_pending`` snapshots may exist
    at once (each one staging buffer, reused); ``max_concurrency`` files of a save
    are written at once; ``background_niceness`` (Linux, CheckpointWriter only)
    lowers the CPU priority of the writer's threads, so training steps keep the
    cores while a save is in flight and the save takes longer.

    ``newer_steps`` says what a save of a step older than the newest committed one
    (after rolling back to an older checkpoint) does: ``"error"`` (default) refuses
    it with StepOrderError, since readers resume from the newest step and would
    skip it; ``"discard"`` saves it and, once it is committed, deletes the committed
    steps newer than it (before retention runs); ``"keep"`` saves it and keeps them.
    The writer lists the root once when it starts and then tracks its own commits.
    A step equal to the newest committed one is CheckpointExistsError in every mode.

    ``list_checkpoints``, ``load`` and ``restore`` read the writer's root with its
    ``storage_options``; they see committed checkpoints only (not pending saves).
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
        max_pending: int = DEFAULT_MAX_PENDING,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
        background_niceness: int = 0,
        newer_steps: NewerSteps = "error",
        retention: RetentionPolicy | None = None,
    ) -> None:
        for name, value in (("max_pending", max_pending), ("max_concurrency", max_concurrency)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, not {value!r}")
        if isinstance(background_niceness, bool) or background_niceness not in range(20):
            raise InvalidArgumentError(
                f"background_niceness must be an int from 0 to 19, not {background_niceness!r}"
            )
        if background_niceness and not sys.platform.startswith("linux"):
            raise InvalidArgumentError("background_niceness needs Linux (per-thread priorities)")
        if newer_steps not in _NEWER_STEPS:
            raise InvalidArgumentError(
                f"newer_steps must be one of {_NEWER_STEPS}, not {newer_steps!r}"
            )
        loose = RetentionPolicy(keep_last, keep_every, keep_best, best_metric, best_mode)
        self.policy = _policy(retention, loose)
        self.background_niceness = background_niceness
        self.newer_steps: NewerSteps = newer_steps
        self.root = str(root)
        self.storage_options = None if storage_options is None else dict(storage_options)
        self._store = open_store(self.root, self.storage_options)
        local = self._store.root if isinstance(self._store, LocalStore) else None
        if local is not None and os.path.exists(local) and not os.path.isdir(local):
            raise StorageError(
                errno.ENOTDIR, f"checkpoint root {self.root} is a file, not a folder"
            )
        self._service = WriteService(
            self._store, self.policy, max_pending, max_concurrency, newer_steps
        )
        self._generation = lifecycle.generation()
        self._pending: list[SaveHandle] = []
        self._closed = False
        self._start()

    def _start(self) -> None:
        """Start the write service where the front end runs it; last step of __init__."""

    @property
    def _inherited(self) -> bool:
        return lifecycle.inherited(self._generation)

    def _check_usable(self) -> None:
        if self._inherited:
            raise WriterClosedError(
                f"this writer for {self.root} was inherited through fork(): its background "
                "thread exists only in the parent; create a new writer in this process"
            )
        if self._closed:
            raise WriterClosedError("this writer is closed; create a new one")

    def _before_save(
        self,
        step: int,
        metrics: Mapping[str, Any] | None,
        metadata: Mapping[str, Any] | None,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Checks on the caller thread, before anything is captured; returns the plain
        metrics and metadata."""
        self._check_usable()
        self._service.failures.raise_first()
        if not is_step(step):
            raise InvalidArgumentError(f"step must be an int from 0 to {MAX_STEP}, not {step!r}")
        self._pending[:] = [h for h in self._pending if not h.done()]
        if any(h.step == step for h in self._pending):
            raise CheckpointExistsError(f"a save of step {step} is already in progress")
        self._check_step_order(step)
        plain_metrics, metrics_bytes = _plain_json(metrics, "metrics")
        plain_metadata, metadata_bytes = _plain_json(metadata, "metadata")
        if metrics_bytes + metadata_bytes > MAX_METADATA_BYTES:
            raise UnsupportedValueError(
                f"metrics and metadata of step {step} encode to {metrics_bytes + metadata_bytes} "
                f"bytes; at most {MAX_METADATA_BYTES} fit in a manifest (readers refuse "
                "larger ones): put large values in the state instead"
            )
        return plain_metrics, plain_metadata

    def _check_step_order(self, step: int) -> None:
        newest = self._service.newest
        if step == newest:
            raise CheckpointExistsError(f"step {step} is already committed under {self.root}")
        if self.newer_steps != "error":
            return
        if newest is not None and step < newest:
            what = f"step {newest}, the newest committed checkpoint"
        elif any(h.step > step for h in self._pending):
            what = f"step {max(h.step for h in self._pending)}, which is being saved,"
        else:
            return
        raise StepOrderError(
            f"step {step} is older than {what} under {self.root}: a resume would pick the "
            "newer step and skip this one. Pass newer_steps='discard' to the writer to delete "
            "the newer steps once this one is committed, or newer_steps='keep' to keep them"
        )

    def _snapshot(
        self,
        step: int,
        state: Mapping[str, Any],
        buffer: StagingBuffer,
        plain: tuple[dict[str, Any], dict[str, Any]],
    ) -> Snapshot:
        created_at = datetime.now(UTC)
        components = capture(state, buffer)
        return Snapshot(step, components, buffer, created_at, *plain)

    def _handle(self, step: int, started: float, event: anyio.Event | None = None) -> SaveHandle:
        handle = SaveHandle(step, started, event, loop_thread=self._service.loop_thread)
        self._pending.append(handle)
        return handle

    def _list(self) -> list[CheckpointInfo]:
        return list_checkpoints(self.root, storage_options=self.storage_options)

    def _load(
        self,
        step: int | None,
        components: Iterable[str] | None,
        map_location: str | torch.device | None,
        verify: bool,
    ) -> Checkpoint:
        return load(
            self.root,
            step,
            components=components,
            storage_options=self.storage_options,
            map_location=map_location,
            verify=verify,
        )

    def _restore(self, targets: Mapping[str, Any], step: int | None, strict: bool) -> RestoreInfo:
        return restore(
            self.root, targets, step, storage_options=self.storage_options, strict=strict
        )


def _policy(retention: RetentionPolicy | None, loose: RetentionPolicy) -> RetentionPolicy:
    """The writer's policy: ``retention`` or the one made of the loose options, never both."""
    if retention is None:
        return loose
    if not isinstance(retention, RetentionPolicy):
        raise InvalidArgumentError(
            f"retention must be a RetentionPolicy, not {type(retention).__qualname__}"
        )
    if loose != RetentionPolicy():
        raise InvalidArgumentError(
            "pass retention=RetentionPolicy(...) or keep_last/keep_every/keep_best/"
            "best_metric/best_mode, not both"
        )
    return retention


def _json_hook(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, np.generic):
        return value.item()
    raise UnsupportedValueError(f"{type(value).__qualname__} is not JSON-able")


def _plain_json(value: Mapping[str, Any] | None, what: str) -> tuple[dict[str, Any], int]:
    """A plain-JSON copy of ``value`` and its encoded size: scalar tensors and NumPy
    scalars become numbers, NaN and infinities become null (JSON has neither)."""
    if value is None:
        return {}, 2
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise UnsupportedValueError(f"{what} must be a mapping with str keys")
    try:
        encoded = msgspec.json.encode(value, enc_hook=_json_hook)
        plain: dict[str, Any] = msgspec.json.decode(encoded)
    except (UnsupportedValueError, TypeError, OverflowError, msgspec.EncodeError) as exc:
        raise UnsupportedValueError(f"{what} must be JSON-able: {exc}") from exc
    except RecursionError:
        raise UnsupportedValueError(
            f"{what} nests deeper than {MAX_JSON_DEPTH} levels: readers refuse such a manifest"
        ) from None
    if too_deep(plain):
        raise UnsupportedValueError(
            f"{what} nests deeper than {MAX_JSON_DEPTH} levels: readers refuse such a manifest"
        )
    return plain, len(encoded)


class CheckpointWriter(_WriterBase, AbstractContextManager["CheckpointWriter"]):
    """Saves checkpoints in the background from synchronous training code.

    Use as a context manager (or call ``close()``). ``save`` and ``wait`` are
    called from one training thread; handles may be waited on from any thread.

    A writer dropped without ``close()`` still finishes its pending saves (its
    background thread closes itself) and warns with a ResourceWarning. In a child
    made by ``fork()`` (DataLoader workers, multiprocessing) the writer is the
    parent's: the child exits as fast as without it and never writes; ``save``
    and ``wait`` raise WriterClosedError there, ``close`` and leaving the ``with``
    block do nothing.
    """

    def _start(self) -> None:
        """Read the newest committed step, then run the service on its own loop thread."""
        try:
            self._service.newest = newest_committed(self._store)
            self._loop = LoopThread(self._service, self.root, self.background_niceness)
        except BaseException:
            self._store.close()
            raise
        self._finalizer = weakref.finalize(
            self, lifecycle.writer_dropped, self._loop, "CheckpointWriter", self._pending
        )
        self._finalizer.atexit = False  # at exit, the exit hook closes the loop

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
        Blocks first while ``max_pending`` saves are in flight; interrupted there
        (Ctrl-C), it leaves the writer as it was. Raises at once for a bad or
        out-of-order step (see ``newer_steps``), an unstorable value or oversized
        metrics/metadata, and raises a background error not yet seen.
        """
        started = time.perf_counter()
        plain = self._before_save(step, metrics, metadata)
        service = self._service
        buffer = self._loop.call_interruptibly(service.acquire_buffer, service.release_buffer)
        try:
            snapshot = self._snapshot(step, state, buffer, plain)
        except BaseException:
            self._loop.call(service.release_buffer, buffer)
            raise
        handle = self._handle(step, started)
        try:
            self._loop.call(service.submit, snapshot, handle)
        except Exception:
            self._pending.remove(handle)
            raise
        handle.blocked_seconds = time.perf_counter() - started
        return handle

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending save is resolved; raise the first error not yet seen.

        Raises CheckpointTimeoutError (a TimeoutError) if saves are still running
        after ``timeout`` seconds; they go on in the background.
        """
        if self._inherited:
            self._check_usable()
        deadline = None if timeout is None else time.monotonic() + timeout
        for handle in list(self._pending):
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not handle._done.wait(remaining):
                raise CheckpointTimeoutError(f"saves still running after {timeout}s")
        self._pending.clear()
        self._service.failures.raise_first()

    def close(self) -> None:
        """Wait for pending saves, stop the service, then raise an error not yet seen.

        Does nothing in a process that inherited the writer through fork.
        """
        if self._closed:
            return
        self._closed = True
        if self._inherited:
            return
        self._finalizer.detach()
        self._loop.close()
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

    def list_checkpoints(self) -> list[CheckpointInfo]:
        """Every committed checkpoint under this writer's root, ascending by step."""
        return self._list()

    def load(
        self,
        step: int | None = None,
        *,
        components: Iterable[str] | None = None,
        map_location: str | torch.device | None = None,
        verify: bool = True,
    ) -> Checkpoint:
        """``checkpointd.load`` on this writer's root and storage options."""
        return self._load(step, components, map_location, verify)

    def restore(
        self, targets: Mapping[str, Any], step: int | None = None, *, strict: bool = True
    ) -> RestoreInfo:
        """``checkpointd.restore`` on this writer's root and storage options."""
        return self._restore(targets, step, strict)


class AsyncCheckpointWriter(_WriterBase):
    """Saves checkpoints in the background from async training code (asyncio or trio).

    Use with ``async with``; the write service runs as a task in the caller's loop
    and its blocking I/O in worker threads. Call ``save``/``wait`` from that loop.
    ``list_checkpoints``, ``load`` and ``restore`` are coroutines too: they run the
    blocking reads (and ``restore``'s ``load_state_dict`` calls) in a worker thread.
    In a process that inherited the writer through fork, ``save``/``wait`` raise
    WriterClosedError and ``aclose`` does nothing.
    """

    _group: TaskGroup | None = None

    async def __aenter__(self) -> AsyncCheckpointWriter:
        if self.background_niceness:
            raise InvalidArgumentError(
                "background_niceness is for CheckpointWriter: these threads are your loop's"
            )
        self._check_usable()
        if self._group is not None:
            raise WriterClosedError("an AsyncCheckpointWriter can be entered once")
        try:
            self._service.newest = await anyio.to_thread.run_sync(newest_committed, self._store)
        except BaseException:
            self._closed = True
            self._store.close()
            raise
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
        if self._group is None and not self._closed and not self._inherited:
            raise WriterClosedError("use the writer inside 'async with'")
        plain = self._before_save(step, metrics, metadata)
        buffer = await self._service.acquire_buffer()
        try:
            snapshot = self._snapshot(step, state, buffer, plain)
        except BaseException:
            self._service.release_buffer(buffer)
            raise
        handle = self._handle(step, started, anyio.Event())
        await self._service.submit(snapshot, handle)
        handle.blocked_seconds = time.perf_counter() - started
        return handle

    async def _drain(self) -> None:
        for handle in list(self._pending):
            if not handle.done():
                assert handle._event is not None
                await handle._event.wait()
        self._pending.clear()

    async def wait(self, timeout: float | None = None) -> None:  # noqa: ASYNC109 - as the sync API
        """Wait until every pending save is resolved; raise the first error not yet seen.

        Raises CheckpointTimeoutError (a TimeoutError, as the sync writer) if saves
        are still running after ``timeout`` seconds; they go on in the background.
        """
        if self._inherited:
            self._check_usable()
        try:
            with anyio.fail_after(timeout):
                await self._drain()
        except TimeoutError:
            raise CheckpointTimeoutError(f"saves still running after {timeout}s") from None
        self._service.failures.raise_first()

    async def aclose(self) -> None:
        """Wait for pending saves, stop the service, then raise an error not yet seen."""
        if self._closed or self._group is None or self._inherited:
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

    async def list_checkpoints(self) -> list[CheckpointInfo]:
        """Every committed checkpoint under this writer's root, ascending by step."""
        return await anyio.to_thread.run_sync(self._list)

    async def load(
        self,
        step: int | None = None,
        *,
        components: Iterable[str] | None = None,
        map_location: str | torch.device | None = None,
        verify: bool = True,
    ) -> Checkpoint:
        """``checkpointd.load`` on this writer's root and storage options (in a worker thread)."""
        return await anyio.to_thread.run_sync(self._load, step, components, map_location, verify)

    async def restore(
        self, targets: Mapping[str, Any], step: int | None = None, *, strict: bool = True
    ) -> RestoreInfo:
        """``checkpointd.restore`` on this writer's root and storage options (in a worker
        thread; nothing else may use ``targets`` until it returns)."""
        return await anyio.to_thread.run_sync(self._restore, targets, step, strict)
