"""The one seam between a writer's front end and whatever makes its saves durable.

A writer (``CheckpointWriter``, ``AsyncCheckpointWriter``) picks one backend when it
is made (``api/opening.open_backend``) and talks to it only through
``WriteBackend``:

- ``write/loop.InProcessBackend``: plans and commits in this process, on an event
  loop (a thread of its own for CheckpointWriter, the caller's loop for
  AsyncCheckpointWriter). The checkpoint service runs the same class for each writer
  opened there (``daemon/saves.HostedBackend``).
- ``daemon/remote.ServiceBackend``: captures into the checkpoint service's shared
  memory and hands each snapshot to the service, which commits it even if this
  process dies.

Call order, on the backend's loop (the writer's loop thread, or the async writer's
loop): ``run`` (started once, after ``newest`` is set), then for each save
``acquire_buffer`` -> capture into it on the caller's thread -> ``submit`` (or
``release_buffer`` if the capture failed); at close ``stop``, then ``close_store``
once ``run`` has returned. ``take_unseen_error`` after that (any thread).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from anyio.abc import TaskStatus

if TYPE_CHECKING:
    from checkpointd.write.capture import StagingBuffer
    from checkpointd.write.handle import Failures, SaveHandle
    from checkpointd.write.incremental import CaptureHold
    from checkpointd.write.plan import Snapshot

__all__ = ["WriteBackend"]


class WriteBackend(Protocol):
    """What a writer's front end needs of the part that writes its snapshots."""

    newest: int | None
    """The newest committed step the writer knows of: set by the writer before ``run``,
    then raised by the backend as saves commit (before their handles resolve). Read by
    the caller's thread without a lock."""

    failures: Failures
    """Background errors nobody has seen raised yet (thread-safe); every handle this
    backend resolves is made with it."""

    @property
    def loop_thread(self) -> int | None:
        """The thread that resolves handles on the caller's event loop (an
        AsyncCheckpointWriter then waits on an event), or None where another thread
        resolves them (the service backend's reader thread)."""

    async def run(self, *, task_status: TaskStatus[None] = ...) -> None:
        """Serve saves until ``stop()``; reports started once ``submit`` may be called."""

    async def acquire_buffer(self) -> StagingBuffer:
        """A staging buffer to capture one save into; waits while ``max_pending`` saves
        hold theirs. Cancellable: a cancelled wait takes no buffer."""

    def release_buffer(self, buffer: StagingBuffer) -> None:
        """Give back a buffer whose save will not be submitted (its capture failed)."""

    def hold_unchanged(self) -> CaptureHold | None:
        """What capture may skip copying as unchanged (an incremental in-process
        writer's previous blobs), held until the save is planned; None: copy every
        tensor. Caller's thread, before capture."""

    async def submit(self, snapshot: Snapshot, handle: SaveHandle) -> None:
        """Queue ``snapshot`` (captured into a buffer of ``acquire_buffer``); ``handle``
        resolves once it is committed or has failed, saves in submission order. Does not
        wait for the write (at most for the hand-over)."""

    async def stop(self) -> None:
        """Let every submitted save resolve, then end ``run``."""

    def close_store(self) -> None:
        """Release what the backend holds (store, group, connection, buffers), once
        ``run`` has returned (or if it never started). Blocking."""

    def take_unseen_error(self) -> BaseException | None:
        """The oldest error nobody has seen raised, marked seen (the exit report)."""
