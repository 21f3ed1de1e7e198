"""The checkpoint writer.

The sync front end over the writer's backend (backend.py; the async front end is async_writer.py).

``save()`` captures the state on the caller's thread and queues the snapshot;
the backend (in this process, loop.py) writes queued snapshots one at a time, in order,
each with its files written concurrently. ``CheckpointWriter`` runs the backend on an
event loop in a thread of its own (lifecycle.py). At most ``max_pending`` snapshots
exist at once (one staging buffer each, reused across saves): ``save()`` waits
for a free one.

A failed save resolves its handle with the error; an error nobody has seen yet
is raised again by ``wait()``, by the next ``save()``, and when the writer closes.
"""

from __future__ import annotations

import signal
import time
import weakref
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from checkpointd.errors import (
    CheckpointError,
    CheckpointTimeoutError,
)
from checkpointd.format.manifest import CheckpointInfo
from checkpointd.read.restore import Checkpoint, RestoreInfo
from checkpointd.write import lifecycle
from checkpointd.write.handle import SaveHandle
from checkpointd.write.lifecycle import LoopThread
from checkpointd.write.loop import newest_committed

if TYPE_CHECKING:
    from checkpointd.write.preemption import PreemptionWatch
from checkpointd.api.writer_base import WriterBase

__all__ = ["CheckpointWriter", "SaveHandle"]


class CheckpointWriter(WriterBase, AbstractContextManager["CheckpointWriter"]):
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

    _preemption: PreemptionWatch | None = None
    _preemption_saved = False

    def _start(self) -> None:
        """Read the newest committed step, then run the backend on its own loop thread."""
        try:
            self._backend.newest = newest_committed(self._store)
            self._loop = LoopThread(self._backend, self.root, self.background_niceness)
        except BaseException:
            self._backend.close_store()
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
        specs: Mapping[str, Any] | None = None,
        associations: Mapping[str, str] | None = None,
    ) -> SaveHandle:
        """Snapshot ``state`` for ``step`` and write it in the background.

        Returns once the snapshot is taken: the caller may change its tensors (with
        ``staging="overlapped"``: once the parameters and optimizer state still being
        copied are guarded by the optimizers' step pre-hooks; see ``wait_staged``).
        Blocks first while ``max_pending`` saves are in flight; interrupted there
        (Ctrl-C), it leaves the writer as it was. Training thread.

        Args:
            step: The training step, an int from 0; later saves need later steps (see
                ``newer_steps``).
            state: Component name -> a module, optimizer, scheduler, Stateful, tensor or
                tree of JSON values and tensors.
            metrics: JSON values kept in the manifest (``keep_best`` ranks by one).
            metadata: JSON values kept in the manifest.
            specs: Component name -> ``checkpointd.spec(...)``, for ``checkpointd.build``.
            associations: Component name -> the component it is built over, for
                ``checkpointd.build``.

        Returns:
            The save's handle: ``result()`` waits until it is committed.

        Raises:
            InvalidArgumentError: ``step`` is not a valid step, or metrics/metadata are
                not plain JSON or too large.
            StepOrderError: ``step`` is older than a committed or pending one.
            CheckpointExistsError: ``step`` is committed or being saved already.
            UnsupportedValueError: A value in ``state`` cannot be stored.
            WriterClosedError: The writer is closed, or inherited through fork().
            CheckpointError: A background error not yet seen (an earlier save's).
        """
        started = time.perf_counter()
        with self._attempt(step) as attempt:
            plain = self._before_save(step, metrics, metadata)
            recorded = self._record_specs(step, state, specs, associations)
            backend = self._backend
            buffer = self._loop.call_interruptibly(backend.acquire_buffer, backend.release_buffer)
            try:
                snapshot, staging = self._snapshot(
                    step, state, buffer, plain, recorded, attempt=attempt
                )
            except BaseException:
                self._loop.call(backend.release_buffer, buffer)
                raise
            handle = self._handle(step, started, staging=staging)
            try:
                self._loop.call(backend.submit, snapshot, handle)
            except Exception:
                self._pending.remove(handle)
                raise
        handle.blocked_seconds = time.perf_counter() - started
        return handle

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the latest save's state is all in host memory.

        Then any of its tensors may change (with ``staging="overlapped"``; at once otherwise).

        For changes other than ``optimizer.step()`` to parameters or optimizer state.
        A copy that failed ends staging too: its error fails the save's handle and is
        raised by ``wait()``, the next ``save()`` or ``close()``. Training thread.

        Args:
            timeout: Seconds to wait at most; None: no limit.

        Raises:
            CheckpointTimeoutError: ``timeout`` ran out first.
            WriterClosedError: The writer is closed, or inherited through fork().
        """
        self._wait_staged(timeout)

    def watch_preemption(self, signals: Iterable[int] = (signal.SIGTERM,)) -> None:
        """Watch ``signals`` (default SIGTERM): their arrival sets ``preempted``.

        Opt-in; call from the main thread. The handler only sets a flag and chains
        any Python handler installed before; the default action (ending the
        process) is replaced, so the loop must save and exit: see
        ``save_if_preempted``. ``close()`` puts the previous handlers back.
        With many ranks, every rank watches and calls ``save_if_preempted`` at
        every step boundary: the ranks agree there.

        Args:
            signals: The signal numbers to watch.

        Raises:
            InvalidArgumentError: No signal given, or not called from the main thread.
            WriterClosedError: The writer is closed, or inherited through fork().
        """
        from checkpointd.write.preemption import PreemptionWatch

        self._check_usable()
        if self._preemption is not None:
            self._preemption.remove()
        self._preemption = PreemptionWatch(signals)

    @property
    def preempted(self) -> bool:
        """Whether a watched preemption signal arrived (False when not watching)."""
        return self._preemption is not None and self._preemption.triggered

    def save_if_preempted(self, step: int, state: Mapping[str, Any], **kwargs: Any) -> bool:
        """Save ``step`` and wait until every save is durable if ``preempted``.

        Saves once per writer: later calls return True without saving again. A
        second signal during the save only sets the flag again, so the save
        completes (or, if the process is killed, nothing of it is published).
        Call from the training thread at a step boundary. With many ranks it is
        a collective (one small all_reduce on the writer's process group, only
        while watching): if any rank was signalled, every rank saves this step.

        Args:
            step: The step to save, as for ``save``.
            state: The state to save, as for ``save``.
            **kwargs: ``save``'s keywords (``metrics``, ``metadata``...).

        Returns:
            True if it saved (now or in an earlier call) and every save is durable;
            False at once if no preemption signal arrived.

        Raises:
            CheckpointError: As ``save`` and ``wait`` raise.
        """
        if self._preemption is None:
            return False
        preempted = self.preempted
        if self._ranks is not None and not self._preemption_saved:
            from checkpointd.write.preemption import any_rank

            preempted = any_rank(preempted, self.options.process_group)
        if not preempted and not self._preemption_saved:
            return False
        if not self._preemption_saved:
            self._preemption_saved = True
            self.save(step, state, **kwargs)
        self.wait()
        return True

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending save is resolved; raise the first error not yet seen.

        Args:
            timeout: Seconds to wait at most; None: no limit. Saves still running then
                go on in the background.

        Raises:
            CheckpointTimeoutError: Saves are still running after ``timeout`` (a
                TimeoutError).
            CheckpointError: The first background error not yet seen.
            WriterClosedError: The writer was inherited through fork().
        """
        if self._inherited:
            self._check_usable()
        deadline = None if timeout is None else time.monotonic() + timeout
        for handle in list(self._pending):
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                handle.exception(remaining)  # waits; the error is raised below, once
            except CheckpointTimeoutError:
                raise CheckpointTimeoutError(f"saves still running after {timeout}s") from None
        self._pending.clear()
        self._backend.failures.raise_first()

    def close(self) -> None:
        """Wait for pending saves, stop the backend, then raise an error not yet seen.

        Does nothing in a process that inherited the writer through fork, or when the
        writer is closed already.

        Raises:
            CheckpointError: The first background error not yet seen.
        """
        if self._closed:
            return
        self._closed = True
        if self._inherited:
            return
        if self._preemption is not None:
            self._preemption.remove()
        if self._stager is not None:
            self._stager.close()  # staging goes on; the loop's close waits for it
        self._finalizer.detach()
        self._loop.close()
        self._pending.clear()
        self._backend.failures.raise_first()

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
        """Every committed checkpoint under this writer's root, ascending by step.

        Returns:
            The CheckpointInfo of each; pending saves are not listed.

        Raises:
            StorageError: The storage could not be listed or read.
        """
        return self._list()

    def load(
        self,
        step: int | None = None,
        *,
        components: Iterable[str] | None = None,
        map_location: str | torch.device | None = None,
        verify: bool = True,
    ) -> Checkpoint:
        """``checkpointd.load`` on this writer's root and storage options.

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
        return self._load(step, components, map_location, verify)

    def restore(
        self, targets: Mapping[str, Any], step: int | None = None, *, strict: bool = True
    ) -> RestoreInfo:
        """``checkpointd.restore`` on this writer's root and storage options.

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
        return self._restore(targets, step, strict)
