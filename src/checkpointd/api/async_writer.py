"""``AsyncCheckpointWriter``.

The async front end, running the writer's backend (backend.py) as a task in the caller's loop
(asyncio or trio) and its blocking I/O in worker threads; otherwise as ``CheckpointWriter``
(writer.py).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any

import anyio
import anyio.to_thread
import torch
from anyio.abc import TaskGroup

from checkpointd.api.writer_base import WriterBase
from checkpointd.errors import (
    CheckpointError,
    CheckpointTimeoutError,
    InvalidArgumentError,
    WriterClosedError,
)
from checkpointd.format.manifest import CheckpointInfo
from checkpointd.read.restore import Checkpoint, RestoreInfo
from checkpointd.write.handle import SaveHandle
from checkpointd.write.loop import newest_committed

__all__ = ["AsyncCheckpointWriter"]


class AsyncCheckpointWriter(WriterBase):
    """Saves checkpoints in the background from async training code (asyncio or trio).

    Use with ``async with``; the backend runs as a task in the caller's loop
    and its blocking I/O in worker threads. Call ``save``/``wait`` from that loop.
    ``list_checkpoints``, ``load`` and ``restore`` are coroutines too: they run the
    blocking reads (and ``restore``'s ``load_state_dict`` calls) in a worker thread.
    In a process that inherited the writer through fork, ``save``/``wait`` raise
    WriterClosedError and ``aclose`` does nothing.
    """

    _group: TaskGroup | None = None

    def _start(self) -> None:
        """The backend starts in ``__aenter__``.

        Here only the table of each pending save's event (set on this loop when it resolves), for
        ``_drain``.
        """
        self._events: weakref.WeakKeyDictionary[SaveHandle, anyio.Event] = (
            weakref.WeakKeyDictionary()
        )

    async def __aenter__(self) -> AsyncCheckpointWriter:
        if self.background_niceness:
            raise InvalidArgumentError(
                "background_niceness is for CheckpointWriter: these threads are your loop's"
            )
        self._check_usable()
        if self._group is not None:
            raise WriterClosedError("an AsyncCheckpointWriter can be entered once")
        try:
            self._backend.newest = await anyio.to_thread.run_sync(newest_committed, self._store)
        except BaseException:
            self._closed = True
            self._backend.close_store()
            raise
        group = anyio.create_task_group()
        await group.__aenter__()
        self._group = group
        await group.start(self._backend.run)
        return self

    async def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        specs: Mapping[str, Any] | None = None,
        associations: Mapping[str, str] | None = None,
    ) -> SaveHandle:
        """Snapshot ``state`` for ``step`` (on the loop's thread) and write it in the background.

        Returns once the snapshot is taken; see ``CheckpointWriter.save``.

        Args:
            step: The training step, as for ``CheckpointWriter.save``.
            state: Component name -> live object or tree, as for ``CheckpointWriter.save``.
            metrics: JSON values kept in the manifest (``keep_best`` ranks by one).
            metadata: JSON values kept in the manifest.
            specs: Component name -> ``checkpointd.spec(...)``, for ``checkpointd.build``.
            associations: Component name -> the component it is built over.

        Returns:
            The save's handle: ``await handle.wait()`` until it is committed.

        Raises:
            WriterClosedError: Not inside ``async with``, closed, or inherited through fork().
            CheckpointError: As ``CheckpointWriter.save`` raises (a bad step or value, a
                background error not yet seen).
        """
        started = time.perf_counter()
        if self._group is None and not self._closed and not self._inherited:
            raise WriterClosedError("use the writer inside 'async with'")
        with self._attempt(step) as attempt:
            plain = self._before_save(step, metrics, metadata)
            recorded = self._record_specs(step, state, specs, associations)
            if self._stager is not None:  # the previous save's copy: waited for off the loop
                await anyio.to_thread.run_sync(self._stager.wait)
            buffer = await self._backend.acquire_buffer()
            try:
                snapshot, staging = self._snapshot(
                    step, state, buffer, plain, recorded, attempt=attempt
                )
            except BaseException:
                self._backend.release_buffer(buffer)
                raise
            # The in-process backend resolves handles on this loop; the service
            # backend's reader thread cannot set an event of this loop.
            event = anyio.Event() if self._backend.loop_thread is not None else None
            handle = self._handle(step, started, event, staging)
            if event is not None:
                self._events[handle] = event
            await self._backend.submit(snapshot, handle)
        handle.blocked_seconds = time.perf_counter() - started
        return handle

    async def wait_staged(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Wait until the latest save's state is all in host memory.

        See ``CheckpointWriter.wait_staged``.

        Args:
            timeout: Seconds to wait at most; None: no limit.

        Raises:
            CheckpointTimeoutError: ``timeout`` ran out first.
            WriterClosedError: The writer is closed, or inherited through fork().
        """
        self._check_usable()
        stager = self._stager
        if stager is not None and not await anyio.to_thread.run_sync(stager.wait, timeout):
            raise CheckpointTimeoutError(f"the latest save still staging after {timeout}s")

    async def _drain(self) -> None:
        for handle in list(self._pending):
            if handle.done():
                continue
            event = self._events.get(handle)
            if event is not None:
                await event.wait()
            else:  # resolved on another thread: its error is raised by the caller
                await anyio.to_thread.run_sync(handle.exception, abandon_on_cancel=True)
        self._pending.clear()

    async def wait(self, timeout: float | None = None) -> None:  # noqa: ASYNC109 - as the sync API
        """Wait until every pending save is resolved; raise the first error not yet seen.

        Args:
            timeout: Seconds to wait at most; None: no limit. Saves still running then
                go on in the background.

        Raises:
            CheckpointTimeoutError: Saves are still running after ``timeout`` (a
                TimeoutError, as the sync writer's).
            CheckpointError: The first background error not yet seen.
        """
        if self._inherited:
            self._check_usable()
        try:
            with anyio.fail_after(timeout):
                await self._drain()
        except TimeoutError:
            raise CheckpointTimeoutError(f"saves still running after {timeout}s") from None
        self._backend.failures.raise_first()

    async def aclose(self) -> None:
        """Wait for pending saves, stop the backend, then raise an error not yet seen.

        Raises:
            CheckpointError: The first background error not yet seen.
        """
        if self._closed or self._group is None or self._inherited:
            self._closed = True
            return
        self._closed = True
        if self._stager is not None:
            self._stager.close()
        group, self._group = self._group, None
        try:
            await self._drain()
        finally:
            await self._backend.stop()
            await group.__aexit__(None, None, None)
            self._backend.close_store()
        self._backend.failures.raise_first()

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
        """Every committed checkpoint under this writer's root, ascending by step.

        Returns:
            The CheckpointInfo of each; pending saves are not listed.

        Raises:
            StorageError: The storage could not be listed or read.
        """
        return await anyio.to_thread.run_sync(self._list)

    async def load(
        self,
        step: int | None = None,
        *,
        components: Iterable[str] | None = None,
        map_location: str | torch.device | None = None,
        verify: bool = True,
    ) -> Checkpoint:
        """``checkpointd.load`` on this writer's root and storage options (in a worker thread).

        Args:
            step: The step to load; None: the newest committed one that reads and verifies.
            components: The names of the components to load; None: all of them.
            map_location: A device (or its name) for the tensors; None: CPU.
            verify: Check the bytes read against the manifest's CRC32Cs.

        Returns:
            The checkpoint: its ``info`` and ``state``.

        Raises:
            CheckpointNotFoundError: Nothing (or not that step or component) is committed.
            CorruptCheckpointError: The checkpoint read fails its checks.
        """
        return await anyio.to_thread.run_sync(self._load, step, components, map_location, verify)

    async def restore(
        self, targets: Mapping[str, Any], step: int | None = None, *, strict: bool = True
    ) -> RestoreInfo:
        """``checkpointd.restore`` on this writer's root and storage options.

        In a worker thread: nothing else may use ``targets`` until it returns.

        Args:
            targets: Component name -> the live object to restore into.
            step: The step to restore; None: the newest committed one.
            strict: Require a component for every target and a target for every component.

        Returns:
            The restored checkpoint's info, with what was restored and skipped.

        Raises:
            RestoreMismatchError: A target and the checkpoint do not match; every
                target is as it was.
            CheckpointNotFoundError: Nothing (or not that step) is committed.
            CorruptCheckpointError: The checkpoint read fails its checks.
        """
        return await anyio.to_thread.run_sync(self._restore, targets, step, strict)
