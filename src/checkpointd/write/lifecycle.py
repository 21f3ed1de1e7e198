"""The lifetime of a writer's background thread: start, close, exit, fork, dropped writers.

- Interpreter exit: threading's pre-join hook closes every open loop, so pending
  saves finish; an error nobody saw is printed (no caller is left to raise it to).
- fork(): only the forking thread exists in the child, so an inherited writer's
  loop is gone there. The child moves to a new *generation*: every writer, loop
  and handle remembers the generation it was made in and refuses to work in a
  later one, and the child's registry of open loops starts empty, so the child
  exits as fast as it would without a writer and never writes anything.
- A CheckpointWriter dropped without ``close()``: its loop stays registered (a
  strong reference) and is closed from a helper thread, so pending saves finish.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from anyio.from_thread import BlockingPortal

from checkpointd import tunables
from checkpointd.errors import WrongThreadError

if TYPE_CHECKING:
    from checkpointd.write.backend import WriteBackend

__all__ = ["LoopThread", "generation", "inherited", "writer_dropped"]

T = TypeVar("T")

_generation = 0
_registry_lock = threading.Lock()
_open: set[LoopThread] = set()
_exit_hook_registered = False


def generation() -> int:
    """How many forks separate this process from the one that imported checkpointd."""
    return _generation


def inherited(made_in: int) -> bool:
    """True if an object made in generation ``made_in`` came into this process through fork."""
    return made_in != _generation


def _after_fork_in_child() -> None:
    """Runs in the child right after fork(): disown every writer of the parent.

    Touches no lock the parent's threads may have held at the fork.
    """
    global _generation, _registry_lock, _open
    _generation += 1
    _registry_lock = threading.Lock()
    _open = set()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class LoopThread:
    """An asyncio event loop in a thread of its own, running one writer's backend.

    Made and closed by a CheckpointWriter's caller thread; ``close`` may also be
    called by the exit hook or by the helper thread of a dropped writer.
    """

    def __init__(self, backend: WriteBackend, root: str, niceness: int = 0) -> None:
        self.backend = backend
        self.root = root
        self.generation = _generation
        self._close_lock = threading.Lock()
        self._closed = False
        started: Future[BlockingPortal] = Future()
        self._thread = threading.Thread(
            target=self._run, args=(started,), name="checkpointd-writer", daemon=True
        )
        self._thread.start()
        self.portal = started.result()
        self.ident: int | None = self._thread.ident
        try:
            if niceness:
                # Worker threads are spawned by the loop's thread and inherit its niceness.
                self.portal.call(_lower_thread_priority, niceness)
            self._backend_done, _ = self.portal.start_task(backend.run)
        except BaseException:
            self._stop_thread()
            raise
        _register(self)

    def _run(self, started: Future[BlockingPortal]) -> None:
        async def main() -> None:
            async with BlockingPortal() as portal:
                started.set_result(portal)
                await portal.sleep_until_stopped()

        try:
            anyio.run(main, backend="asyncio")
        except BaseException as exc:
            if not started.done():
                started.set_exception(exc)

    @property
    def inherited(self) -> bool:
        """True in a process that got this loop through fork (the thread is not here)."""
        return self.generation != _generation

    def call(self, fn: Callable[..., Awaitable[Any] | Any], *args: Any) -> Any:
        """Run ``fn`` on the loop and return its result (blocking; not from the loop thread)."""
        return self.portal.call(fn, *args)

    def call_interruptibly(self, fn: Callable[[], Awaitable[T]], undo: Callable[[T], None]) -> T:
        """``call(fn)``, but if the caller is interrupted (KeyboardInterrupt) while it
        waits, what ``fn`` produced anyway is handed to ``undo`` on the loop, exactly once.
        A Ctrl-C is seen within ``tunables.INTERRUPT_POLL_SECONDS`` even if its signal did not
        wake the wait. Caller's thread (the main one, for Ctrl-C)."""
        lock = threading.Lock()
        abandoned = False
        produced: list[T] = []

        async def guarded() -> T:
            value = await fn()
            with lock:
                if abandoned:
                    undo(value)
                else:
                    produced.append(value)
            return value

        future: Future[T] | None = None
        try:
            # Inside the try: the loop may start ``fn`` before start_task_soon returns.
            future = self.portal.start_task_soon(guarded)
            # A wait with a timeout, again and again: a SIGINT that lands as this thread
            # starts to block does not wake an untimed wait (CPython runs the handler only
            # once the wait ends: here, once another save frees a buffer, maybe minutes).
            while not wait([future], timeout=tunables.INTERRUPT_POLL_SECONDS).done:
                pass
            return future.result()
        except BaseException:
            with lock:
                abandoned = True
            if future is not None:
                future.cancel()  # stops the wait on the loop, if it is still waiting
            if produced:
                self.portal.start_task_soon(undo, produced[0])
            raise

    def close(self) -> None:
        """Let queued saves finish, then stop the backend and the thread.

        Blocking; idempotent (a second caller waits for the first). Never call it
        from the loop thread, nor in a process that inherited the loop.
        """
        if threading.get_ident() == self.ident:
            raise WrongThreadError("a writer cannot be closed from its own event loop thread")
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            try:
                self.portal.call(self.backend.stop)
                self._backend_done.result()
            finally:
                self._stop_thread()
                self.backend.close_store()
                _unregister(self)

    def close_and_report(self, why: str) -> None:
        """``close``, then print (to stderr) an error nobody saw: there is no caller left."""
        try:
            self.close()
            error = self.backend.take_unseen_error()
        except Exception as exc:
            error = exc
        if error is not None:
            print(f"checkpointd: {why} writer for {self.root}: {error}", file=sys.stderr)

    def _stop_thread(self) -> None:
        with contextlib.suppress(RuntimeError):  # the portal already stopped
            self.portal.call(self.portal.stop)
        self._thread.join()


def _lower_thread_priority(niceness: int) -> None:
    """Set the calling thread's niceness (Linux: PRIO_PROCESS with a thread id is per thread)."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)


def _register(loop: LoopThread) -> None:
    global _exit_hook_registered
    with _registry_lock:
        _open.add(loop)
        if not _exit_hook_registered:
            # threading's own pre-join hook (what concurrent.futures uses): plain atexit
            # runs only after non-daemon threads (a dropped writer's closer) are joined.
            register = getattr(threading, "_register_atexit", None)
            if register is not None:
                register(_close_open_loops)
            _exit_hook_registered = True


def _unregister(loop: LoopThread) -> None:
    with _registry_lock:
        _open.discard(loop)


def _close_open_loops() -> None:
    """At interpreter exit, finish the pending saves of writers nobody closed."""
    with _registry_lock:
        loops = list(_open)
    for loop in loops:
        loop.close_and_report("unclosed")


def writer_dropped(loop: LoopThread, kind: str, pending: Sequence[Any]) -> None:
    """Finalizer of a CheckpointWriter collected without ``close()`` (any thread).

    Closes the loop from a helper thread, so pending saves finish, the caller is
    not held up, and a collection on the loop's own thread cannot deadlock; then
    warns (ResourceWarning) if saves were pending. Does nothing in a fork child.
    """
    if loop.inherited:
        return
    waiting = [h for h in pending if not h.done()]
    closer = threading.Thread(
        target=loop.close_and_report, args=("dropped",), name="checkpointd-close"
    )
    with contextlib.suppress(RuntimeError):  # shutting down: the exit hook closes it
        closer.start()
    if waiting:
        warnings.warn(
            f"{kind} for {loop.root} was dropped without close() while {len(waiting)} "
            f"save(s) were pending (steps {[h.step for h in waiting]}); they finish in the "
            "background. Use 'with' or call close().",
            ResourceWarning,
            stacklevel=2,
        )
