"""What both writer front ends share: options, checks on the caller's thread, pending
handles, and reading the writer's own root.

Everything here runs on the caller's thread (the training thread, or the event
loop of an AsyncCheckpointWriter): it validates before anything is captured,
so a bad call raises at once instead of failing in the background.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

import anyio
import torch

from checkpointd import tunables
from checkpointd.errors import (
    CheckpointExistsError,
    CheckpointTimeoutError,
    InvalidArgumentError,
    StepOrderError,
    StorageError,
    UnsupportedValueError,
    WriterClosedError,
)
from checkpointd.format.layout import MAX_STEP, is_step
from checkpointd.format.manifest import CheckpointInfo, SpecEntry
from checkpointd.maintain.retention import RetentionPolicy
from checkpointd.ranks.group import Group, split_state, writer_group
from checkpointd.read.restore import Checkpoint, RestoreInfo, list_checkpoints, load, restore
from checkpointd.storage import LocalStore, open_store
from checkpointd.write import lifecycle
from checkpointd.write.capture import BufferPool, StagingBuffer, capture
from checkpointd.write.handle import SaveHandle
from checkpointd.write.loop import NewerSteps, WriteService
from checkpointd.write.plan import Snapshot
from checkpointd.write.staging import STAGING_MODES, Stager, Staging, StagingMode
from checkpointd.write.writer_args import plain_metrics_and_metadata, writer_policy

if TYPE_CHECKING:
    from checkpointd.daemon.remote import RemoteService

__all__ = ["WriterBase"]

_NEWER_STEPS = ("error", "keep", "discard")


class WriterBase:
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

    ``process_group``: with torch.distributed initialized, None (default) means every
    rank of the default group saves each checkpoint together (every rank makes the
    writer and calls ``save`` with the same step; see the README, "Many ranks"); a
    process group (``new_group``: a pipeline stage, a subset of ranks) means its ranks
    alone save together, and other ranks need not make a writer;
    ``checkpointd.LOCAL`` makes this process save alone.

    ``incremental``: a tensor of at least ``tunables.INCREMENTAL_MIN_BYTES`` whose bytes
    equal one of the writer's previous committed checkpoint is not written again: the
    manifest references the stored bytes (a shared blob, by XXH3-128 digest; see
    incremental.py and docs/format.md). Every checkpoint still loads whole on its own;
    retention and gc delete a blob only when no committed manifest uses it. Single
    process only for now: with many ranks it raises InvalidArgumentError.

    ``staging``: ``"blocking"`` (default) copies the whole state into host memory
    before ``save()`` returns. ``"overlapped"`` copies the parameters of the
    optimizers in the state and those optimizers' state tensors in the background
    while training goes on (a step pre-hook on each such optimizer waits for the
    copy, so ``optimizer.step()`` cannot change them mid-copy); every other tensor
    (buffers such as BatchNorm statistics, EMA weights, user tensors) is copied
    before ``save()`` returns. Only ``optimizer.step()`` is guarded: change those
    tensors any other way only after ``wait_staged()``. See staging.py.

    ``service``: None (default) writes in this process, in a background thread.
    ``"auto"`` or a socket path writes through the checkpoint service (README, "The
    checkpoint service"): ``save()`` captures into the service's shared memory and
    returns once the service owns the snapshot, which then commits even if this
    process dies. With ``incremental=True`` the service references unchanged tensors
    (the same files), but every tensor is copied into its memory at ``save()``. Not
    yet with overlapped staging or AsyncCheckpointWriter (InvalidArgumentError).

    ``buffer_pool``: a BufferPool that several writers share, one after another: this
    one takes its staging buffers from it and gives them back once closed (the
    Lightning plugin's writers, one per root). Not with ``service=``.

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
        buffer_pool: BufferPool | None = None,
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
        if not isinstance(incremental, bool):
            raise InvalidArgumentError(f"incremental must be a bool, not {incremental!r}")
        if newer_steps not in _NEWER_STEPS:
            raise InvalidArgumentError(
                f"newer_steps must be one of {_NEWER_STEPS}, not {newer_steps!r}"
            )
        if staging not in STAGING_MODES:
            raise InvalidArgumentError(f"staging must be one of {STAGING_MODES}, not {staging!r}")
        loose = RetentionPolicy(keep_last, keep_every, keep_best, best_metric, best_mode)
        self.policy = writer_policy(retention, loose)
        self.background_niceness = background_niceness
        self.staging: StagingMode = staging
        self._stager = Stager() if staging == "overlapped" else None
        self.newer_steps: NewerSteps = newer_steps
        self.root = str(root)
        self.storage_options = None if storage_options is None else dict(storage_options)
        self._store = open_store(self.root, self.storage_options)
        local = self._store.root if isinstance(self._store, LocalStore) else None
        if local is not None and os.path.exists(local) and not os.path.isdir(local):
            raise StorageError(
                errno.ENOTDIR, f"checkpoint root {self.root} is a file, not a folder"
            )
        root = local or self._store.url.rstrip("/")
        self._ranks = writer_group(process_group, root, service)
        self._process_group = process_group  # restore's place: this rank in this group
        if incremental and self._ranks is not None:
            self._ranks.close()
            self._store.close()
            raise InvalidArgumentError(
                "incremental=True is for a writer that saves alone for now: this one saves "
                f"with {self._ranks.world_size} ranks (pass process_group=checkpointd.LOCAL, "
                "or drop incremental)"
            )
        self.incremental = incremental
        self.service = None if service is None else os.fspath(service)
        self._service: WriteService | RemoteService
        if self.service is None:
            self._service = WriteService(
                self._store,
                self.policy,
                max_pending,
                max_concurrency,
                newer_steps,
                group=self._ranks,
                incremental=incremental,
                pool=buffer_pool,
            )
        else:
            from checkpointd.daemon.remote import open_remote

            try:
                self._service = open_remote(
                    self, max_pending, max_concurrency, pooled=buffer_pool is not None
                )
            except BaseException:
                if self._ranks is not None:
                    self._ranks.close()
                self._store.close()
                raise
        self._generation = lifecycle.generation()
        self._pending: list[SaveHandle] = []
        self._closed = False
        self._specs: dict[str, SpecEntry] | None = None  # the previous save's, None: unread
        self._start()

    def _start(self) -> None:
        """Start the write service where the front end runs it; last step of __init__."""

    @property
    def newest_step(self) -> int | None:
        """The newest committed step this writer knows of (None: none yet): read from the
        root when the writer starts, then its own commits. Caller's thread."""
        return self._service.newest

    @property
    def world_size(self) -> int:
        """How many ranks save each checkpoint of this writer (1: it saves alone)."""
        return 1 if self._ranks is None else self._ranks.world_size

    @property
    def group(self) -> Group | None:
        """The ranks this writer saves with (None: alone); the service's remote uses it."""
        return self._ranks

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
        return plain_metrics_and_metadata(step, metrics, metadata)

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
            self._specs = previous_specs(self._store, self._service.newest)
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
        created_at = datetime.now(UTC)
        group = self._ranks
        captured, per_rank = split_state(state, None if group is None else group.rank)
        staging, copier = None, None
        if self._stager is not None:
            # before optimizers become state dicts by parameter name: the stager finds
            # them (and their tensors, which those state dicts share) here
            staging, copier = self._stager.begin(captured)
        saver = self._service.incremental
        hold = None if saver is None else saver.hold()  # what capture finds unchanged
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
        )
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
        service = self._service
        handle = SaveHandle(
            step,
            started,
            event,
            loop_thread=service.loop_thread,
            staging=staging,
            failures=service.failures,
        )
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
            self.root,
            targets,
            step,
            storage_options=self.storage_options,
            strict=strict,
            process_group=self._process_group,
        )


def _distributed() -> bool:
    """True if torch.distributed is initialized (DTensors may be in the state)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
