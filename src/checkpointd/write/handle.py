"""SaveHandle, the outcome of one save, and the record of background errors nobody saw yet."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from checkpointd.errors import CheckpointTimeoutError, WriterClosedError, WrongThreadError
from checkpointd.format.manifest import CheckpointInfo
from checkpointd.storage.base import shown
from checkpointd.write import lifecycle

if TYPE_CHECKING:
    from checkpointd.write.staging import Staging

__all__ = ["Failures", "SaveHandle", "first_leaf"]

_log = logging.getLogger(__name__)


class SaveHandle:
    """The outcome of one ``save()``.

    Resolved by the writer once the checkpoint is committed (or failed). ``result()`` may be called
    from any thread but the writer's own event-loop thread; ``wait()`` from any event loop.

    In a process forked while the save was pending, the save is the parent's:
    ``result()`` and ``wait()`` raise WriterClosedError instead of waiting forever.
    """

    def __init__(
        self,
        step: int,
        started: float,
        event: anyio.Event | None = None,
        *,
        loop_thread: int | None = None,
        staging: Staging | None = None,
        failures: Failures | None = None,
        where: str = "",
    ) -> None:
        """Made by a writer (or the checkpoint service) for each save, not by its users.

        Args:
            step: The step saved.
            started: When ``save()`` was called (``time.perf_counter()``).
            event: Set on the loop thread ``loop_thread`` when the save resolves.
            loop_thread: The thread that resolves it (``result()`` there would hang).
            staging: An overlapped save's copy, still running.
            failures: The writer's record of errors not yet seen (``result()`` marks the
                one it raises as seen).
            where: The root in the log, as it may be shown (no credentials).
        """
        self.step = step
        self._where = where
        self.blocked_seconds = 0.0
        """Seconds ``save()`` held the caller (waiting for a buffer plus capture)."""
        self.durable_seconds: float | None = None
        """Seconds from the call to ``save()`` until committed; None until done."""
        self._started = started
        self._event = event
        self._loop_thread = loop_thread
        self._generation = lifecycle.generation()
        self._done = threading.Event()
        self._info: CheckpointInfo | None = None
        self._error: BaseException | None = None
        self._failures = failures
        self._staging = staging  # overlapped staging only

    def done(self) -> bool:
        """Whether the save is resolved.

        Returns:
            True once the save is committed or has failed.
        """
        return self._done.is_set()

    def staged(self) -> bool:
        """Whether the state is copied into host memory, so that it may change.

        Always True in the blocking staging mode (``save()`` returned after the copy); with
        ``staging="overlapped"`` the copy of optimized parameters and optimizer state may still run
        when ``save()`` returns. A failed copy counts as staged (it has ended; ``result()`` raises
        its error). Any thread.

        Returns:
            True once the copy has ended.
        """
        return self._staging is None or self._staging.done()

    @property
    def staging(self) -> Staging | None:
        """The background copy of an overlapped save (None with blocking staging).

        The writer awaits it before it writes the snapshot.
        """
        return self._staging

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until ``staged()``. Any thread.

        Args:
            timeout: Seconds to wait at most; None: no limit.

        Raises:
            CheckpointTimeoutError: ``timeout`` ran out first.
            WriterClosedError: The handle was inherited through fork().
        """
        if self.staged():
            return
        self._check_waitable()
        assert self._staging is not None
        if not self._staging.wait(timeout):
            raise CheckpointTimeoutError(f"save of step {self.step} still staging after {timeout}s")

    def result(self, timeout: float | None = None) -> CheckpointInfo:
        """Block until the save resolves; return its CheckpointInfo or raise its error.

        Args:
            timeout: Seconds to wait at most; None: no limit.

        Returns:
            The committed checkpoint's CheckpointInfo.

        Raises:
            CheckpointTimeoutError: It is still running after ``timeout`` (a TimeoutError).
            WrongThreadError: Called, while pending, on the event-loop thread that resolves
                it (it would wait forever: use ``await handle.wait()`` there).
            WriterClosedError: The handle was inherited through fork().
            CheckpointError: The save's own error (marked seen).
        """
        self._block("result", timeout)
        return self._outcome()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Block until the save resolves; return its error, or None once committed.

        Unlike ``result()`` it raises neither the error nor marks it seen: the writer's
        ``wait()``, next ``save()`` or ``close()`` still raise it.

        Args:
            timeout: Seconds to wait at most; None: no limit.

        Returns:
            The save's error, or None once it is committed.

        Raises:
            CheckpointTimeoutError: It is still running after ``timeout``.
            WrongThreadError: Called, while pending, on the loop thread that resolves it.
            WriterClosedError: The handle was inherited through fork().
        """
        self._block("exception", timeout)
        return self._error

    async def wait(self) -> CheckpointInfo:
        """Await the save's resolution; return its CheckpointInfo or raise its error.

        Returns:
            The committed checkpoint's CheckpointInfo.

        Raises:
            WriterClosedError: The handle was inherited through fork().
            CheckpointError: The save's own error (marked seen).
        """
        if not self._done.is_set():
            self._check_waitable()
            if self._event is not None:
                await self._event.wait()
            else:
                await anyio.to_thread.run_sync(self._done.wait, abandon_on_cancel=True)
        return self._outcome()

    def _block(self, method: str, timeout: float | None) -> None:
        """Wait for the resolution on a thread that may block (``result``, ``exception``)."""
        if not self._done.is_set():
            self._check_waitable()
            if threading.get_ident() == self._loop_thread:
                raise WrongThreadError(
                    f"handle.{method}() for step {self.step} was called on the writer's event "
                    "loop thread, which resolves it: it would wait forever; "
                    "use 'await handle.wait()' in async code"
                )
        if not self._done.wait(timeout):
            raise CheckpointTimeoutError(f"save of step {self.step} still running after {timeout}s")

    def _check_waitable(self) -> None:
        if lifecycle.inherited(self._generation):
            raise WriterClosedError(
                f"the save of step {self.step} belongs to the parent process: this handle "
                "was inherited through fork() and never resolves here"
            )

    def _outcome(self) -> CheckpointInfo:
        if self._error is not None:
            if self._failures is not None:
                self._failures.observe(self._error)
            raise self._error
        assert self._info is not None
        return self._info

    def resolve(self, info: CheckpointInfo | None, error: BaseException | None) -> None:
        """The writer's side: the save committed as ``info`` or failed with ``error``.

        Called once, by the writer's event loop (or the checkpoint service's reader); logs
        the outcome (INFO committed, WARNING failed, under this module's logger).

        Args:
            info: The committed checkpoint's info (None if it failed).
            error: Why it failed (None if it committed).
        """
        self._info, self._error = info, error
        self.durable_seconds = time.perf_counter() - self._started
        if error is None and info is not None:
            _log.info(
                "committed step %d%s (%d bytes, %.2fs after save())",
                self.step,
                f" to {self._where}" if self._where else "",
                info.nbytes,
                self.durable_seconds,
            )
        elif error is not None:
            _log.warning(
                "step %d%s failed: %s",
                self.step,
                f" of {self._where}" if self._where else "",
                shown(str(error) or type(error).__name__),
            )
        self._done.set()
        if self._event is not None:
            self._event.set()

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error else "committed")
        return f"<SaveHandle step={self.step} {state}>"


class Failures:
    """Errors from the background that nobody has seen raised yet. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._unseen: list[BaseException] = []

    def add(self, error: BaseException) -> None:
        """Record ``error``, not seen yet."""
        with self._lock:
            self._unseen.append(error)

    def observe(self, error: BaseException) -> None:
        """Mark ``error`` seen (raised to the caller)."""
        with self._lock:
            self._unseen = [e for e in self._unseen if e is not error]

    def take_first(self) -> BaseException | None:
        """Remove and return the oldest unseen error, if any."""
        with self._lock:
            return self._unseen.pop(0) if self._unseen else None

    def raise_first(self) -> None:
        """Raise the oldest unseen error (marking it seen), if any."""
        error = self.take_first()
        if error is not None:
            raise error


def first_leaf(error: BaseException) -> BaseException:
    """The first concrete error inside (possibly nested) exception groups."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error
