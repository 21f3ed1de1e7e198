"""What both writer front ends share: options, checks on the caller's thread, pending
handles; reading the writer's own root is root_reads.py's, a save's step checks
save_checks.py's.

Everything here runs on the caller's thread (the training thread, or the event
loop of an AsyncCheckpointWriter): it validates before anything is captured,
so a bad call raises at once instead of failing in the background.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import Any, Literal

import anyio

from checkpointd import tunables
from checkpointd.api import opening
from checkpointd.api.root_reads import RootReads
from checkpointd.errors import CheckpointTimeoutError, UnsupportedValueError, WriterClosedError
from checkpointd.format.manifest import SpecEntry
from checkpointd.maintain.retention import RetentionPolicy
from checkpointd.ranks.group import split_state
from checkpointd.storage.base import shown
from checkpointd.write import lifecycle
from checkpointd.write.capture import BufferPool, StagingBuffer, capture
from checkpointd.write.handle import SaveHandle
from checkpointd.write.loop import NewerSteps
from checkpointd.write.options import SaveTarget, WriterOptions
from checkpointd.write.plan import Snapshot
from checkpointd.write.save_checks import check_step
from checkpointd.write.staging import Stager, Staging, StagingMode
from checkpointd.write.writer_args import plain_metrics_and_metadata

__all__ = ["WriterBase"]

_log = logging.getLogger(__name__)


class WriterBase(RootReads):
    """What both front ends share: options, validation, pending handles, error surfacing.

    ``root`` is a local path or fsspec URL, resolved once here into the writer's
    ``SaveTarget`` (a relative path names a folder under this process's working folder,
    also through the service, whose working folder is its own; the layout tunables are
    read then too, so later changes to them do not apply to this writer). The keywords
    are the writer's options, each described in ``WriterOptions`` (write/options.py):
    every one is checked when the writer is made (InvalidArgumentError) and kept in
    ``options``.

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
        max_pending: int = tunables.DEFAULT_MAX_PENDING,
        max_concurrency: int = tunables.DEFAULT_MAX_CONCURRENCY,
        background_niceness: int = 0,
        newer_steps: NewerSteps = "error",
        retention: RetentionPolicy | None = None,
        process_group: Any = None,
        incremental: bool = False,
        staging: StagingMode = "blocking",
        service: str | os.PathLike[str] | None = None,
        chunk_bytes: int | None = None,
        join_seconds: float | None = None,
        buffer_pool: BufferPool | None = None,
        replicas: int = 0,
    ) -> None:
        """Open ``root`` with the writer's options, each checked here.

        Each option is described in full in ``WriterOptions`` (write/options.py).

        Args:
            root: A local path (made absolute here) or fsspec URL to save under.
            storage_options: fsspec options for ``root`` (credentials, endpoint...).
            keep_last: Retention: keep the newest N checkpoints.
            keep_every: Retention: keep steps divisible by K.
            keep_best: Retention: keep the K best by ``metrics[best_metric]``.
            best_metric: The metrics key ``keep_best`` ranks by.
            best_mode: "min" or "max": which values of ``best_metric`` are best.
            max_pending: Snapshots that may exist at once (one staging buffer each).
            max_concurrency: Files of a save written at once.
            background_niceness: Lower CPU priority of the writer's threads (Linux;
                CheckpointWriter only).
            newer_steps: What a save older than the newest committed step does:
                "error", "discard" (the newer steps once it commits) or "keep".
            retention: A RetentionPolicy, instead of the ``keep_*`` options.
            process_group: Who saves together: None the default group's ranks, a
                process group its ranks, ``checkpointd.LOCAL`` this process alone.
            incremental: Write a large tensor unchanged since the previous checkpoint
                once, then reference it.
            staging: "blocking" or "overlapped" (optimizer-owned tensors copied while
                training goes on).
            service: "auto" or a checkpoint service's socket path to write through;
                None: in this process.
            chunk_bytes: Bytes handed to storage per write (default
                ``tunables.CHUNK_BYTES``).
            join_seconds: How long ranks wait for one that has not joined a save
                (default ``tunables.JOIN_SECONDS``).
            buffer_pool: A BufferPool shared by writers one after another.
            replicas: With ``service=`` and many ranks: other nodes' services that
                also hold each rank's share of a save in memory (default 0).

        Raises:
            InvalidArgumentError: An option is out of range or of the wrong kind.
            StorageError: ``root`` cannot be opened.
            ServiceError: The checkpoint service cannot be reached (with ``service``).
        """
        self.options = WriterOptions(
            storage_options=storage_options,
            keep_last=keep_last,
            keep_every=keep_every,
            keep_best=keep_best,
            best_metric=best_metric,
            best_mode=best_mode,
            retention=retention,
            max_pending=max_pending,
            max_concurrency=max_concurrency,
            background_niceness=background_niceness,
            newer_steps=newer_steps,
            process_group=process_group,
            incremental=incremental,
            staging=staging,
            service=service,
            buffer_pool=buffer_pool,
            chunk_bytes=tunables.CHUNK_BYTES if chunk_bytes is None else chunk_bytes,
            join_seconds=tunables.JOIN_SECONDS if join_seconds is None else join_seconds,
            replicas=replicas,
        )
        self._target = SaveTarget.of(str(root), self.options)
        """What every save of this writer means: root, storage options, layout."""
        self.root = self._target.root  # this process's folder, not the service's
        self._stager = Stager() if self.options.staging == "overlapped" else None
        self._store = opening.open_root(self._target)
        try:
            self._ranks = opening.open_group(self._store, self.options)
            self._backend = opening.open_backend(
                self._target, self._store, self.options, self._ranks
            )
        except BaseException:
            self._store.close()
            raise
        self._generation = lifecycle.generation()
        self._pending: list[SaveHandle] = []
        self._closed = False
        self._specs: dict[str, SpecEntry] | None = None  # the previous save's, None: unread
        self._start()

    @property
    def policy(self) -> RetentionPolicy:
        """The retention policy in effect (``retention``, or the ``keep_*`` options')."""
        return self.options.policy

    @property
    def storage_options(self) -> dict[str, Any] | None:
        """The fsspec options of ``root`` (a copy of the ones given)."""
        return None if self.options.storage_options is None else dict(self.options.storage_options)

    @property
    def background_niceness(self) -> int:
        """The niceness the writer's background threads run at (0: unchanged)."""
        return self.options.background_niceness

    @property
    def newer_steps(self) -> NewerSteps:
        """What a save older than the newest committed step does ("error", ...)."""
        return self.options.newer_steps

    @property
    def incremental(self) -> bool:
        """Whether unchanged large tensors are referenced instead of written again."""
        return self.options.incremental

    @property
    def staging(self) -> StagingMode:
        """The staging mode: "blocking" or "overlapped"."""
        return self.options.staging

    @property
    def service(self) -> str | None:
        """The checkpoint service written through: "auto" or a socket path; None: none."""
        return self.options.service_path

    def _start(self) -> None:
        """Start the backend where the front end runs it; last step of __init__."""

    @property
    def newest_step(self) -> int | None:
        """The newest committed step this writer knows of (None: none yet): read from the
        root when the writer starts, then its own commits. Caller's thread."""
        return self._backend.newest

    @property
    def world_size(self) -> int:
        """How many ranks save each checkpoint of this writer (1: it saves alone)."""
        return 1 if self._ranks is None else self._ranks.world_size

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
        self._backend.failures.raise_first()
        self._pending[:] = [h for h in self._pending if not h.done()]
        check_step(
            step,
            newest=self._backend.newest,
            pending=self._pending,
            newer_steps=self.newer_steps,
            root=self.root,
        )
        return plain_metrics_and_metadata(step, metrics, metadata)

    def _record_specs(
        self,
        step: int,
        state: Mapping[str, Any],
        specs: Mapping[str, Any] | None,
        associations: Mapping[str, str] | None,
    ) -> dict[str, SpecEntry]:
        """The manifest's ``specs`` for this save (spec.py); warns where one changed."""
        if not specs and not associations:
            return {}
        from checkpointd.rebuild.spec import previous_specs, record, warn_changed

        recorded = record(state, specs or {}, associations or {})
        if self._specs is None:
            self._specs = previous_specs(self._store, self._backend.newest)
        warn_changed(self._specs, recorded, step)
        self._specs = recorded
        return recorded

    def _snapshot(
        self,
        step: int,
        state: Mapping[str, Any],
        buffer: StagingBuffer,
        plain: tuple[dict[str, Any], dict[str, Any]],
        specs: dict[str, SpecEntry] | None,
        *,
        attempt: int,
    ) -> tuple[Snapshot, Staging | None]:
        """Capture ``state`` into ``buffer``. Overlapped staging: waits for the previous
        save's staging first, and returns this save's Staging (copies may still run)."""
        _log.debug("step %d of %s: save started", step, shown(self.root))
        created_at = datetime.now(UTC)
        group = self._ranks
        captured, per_rank = split_state(state, None if group is None else group.rank)
        staging, copier = None, None
        if self._stager is not None:
            # before optimizers become state dicts by parameter name: the stager finds
            # them (and their tensors, which those state dicts share) here
            staging, copier = self._stager.begin(captured)
        hold = self._backend.hold_unchanged()  # what capture may find unchanged
        try:
            if group is not None or _distributed():
                from checkpointd.state.optimizers import by_parameter_name

                captured = by_parameter_name(captured, ranked=group is not None)
            components = capture(
                captured,
                buffer,
                copier,
                ranked=group is not None,
                prehash=None if hold is None else hold.prehash,
            )
            if held := [c.name for c in components if c.shards and c.name in per_rank]:
                raise UnsupportedValueError(
                    f"per-rank components {[per_rank[n] for n in held]} hold DTensors: save "
                    "DTensors in ordinary components (each rank's shards are stored as its own)"
                )
        except BaseException:
            if staging is not None and staging.started:
                staging.wait()  # the caller releases the buffer: no copy may still write
            if hold is not None:
                hold.release()
            raise
        snapshot = Snapshot(
            step,
            components,
            buffer,
            created_at,
            *plain,
            specs=specs or {},
            attempt=attempt,
            per_rank=per_rank,
            rank=0 if group is None else group.rank,
            layout=self._target.layout,
        )
        nbytes = sum(c.nbytes for c in components)
        _log.debug("step %d: captured %d bytes of %d components", step, nbytes, len(components))
        if staging is None or not staging.hand_over(lambda error: _staged(step, error)):
            _staged(step, None if staging is None else staging.error)
        return snapshot, staging

    @contextlib.contextmanager
    def _attempt(self, step: int) -> Iterator[int]:
        """This save's attempt number at ``step`` (0 alone), taken before anything can
        refuse the save, so the ranks number their attempts alike; a save refused inside
        abandons its attempt, and the other ranks fail at once. Caller thread."""
        group = self._ranks
        if group is None or not isinstance(step, int):
            yield 0
            return
        number = group.attempt(step)
        try:
            yield number
        except BaseException as exc:
            from checkpointd.ranks.attempt import abandon

            abandon(group, step, number, f"its save() was refused ({type(exc).__name__}: {exc})")
            raise

    def _wait_staged(self, timeout: float | None) -> None:
        """Block until the latest save's staging has ended (caller's thread)."""
        self._check_usable()
        if self._stager is not None and not self._stager.wait(timeout):
            raise CheckpointTimeoutError(f"the latest save still staging after {timeout}s")

    def _handle(
        self,
        step: int,
        started: float,
        event: anyio.Event | None = None,
        staging: Staging | None = None,
    ) -> SaveHandle:
        backend = self._backend
        handle = SaveHandle(
            step,
            started,
            event,
            loop_thread=backend.loop_thread,
            staging=staging,
            failures=backend.failures,
            where=shown(self.root),
        )
        self._pending.append(handle)
        return handle


def _staged(step: int, error: BaseException | None) -> None:
    """Log that ``step``'s state is all in host memory (a failed copy fails the save, and
    its handle logs that). On the thread that ended the copy."""
    if error is None:
        _log.debug("step %d: staged", step)


def _distributed() -> bool:
    """True if torch.distributed is initialized (DTensors may be in the state)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
