"""A writer's options, checked once: one frozen object made from the writer's keywords.

``CheckpointWriter(root, **keywords)`` and ``AsyncCheckpointWriter`` make a
``WriterOptions`` from their keywords, and the framework plugins make one from
theirs when they are made, so a bad option is refused there and then with
InvalidArgumentError, not at the first save. ``WriterKeywords`` types those
keywords where a plugin forwards them (``CheckpointdIO(**writer_options)``).
``WriterOptions(...).keywords()`` gives them back for a writer. Any thread.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict, cast

from checkpointd import tunables
from checkpointd.errors import InvalidArgumentError
from checkpointd.format.layout import SaveLayout
from checkpointd.maintain.retention import RetentionPolicy
from checkpointd.storage import resolve_root
from checkpointd.write.capture import BufferPool
from checkpointd.write.loop import NewerSteps
from checkpointd.write.staging import STAGING_MODES, StagingMode

__all__ = ["NEWER_STEPS", "SaveTarget", "WriterKeywords", "WriterOptions"]

NEWER_STEPS: tuple[NewerSteps, ...] = ("error", "keep", "discard")

_RETENTION_KEYWORDS = ("keep_last", "keep_every", "keep_best", "best_metric", "best_mode")


class WriterKeywords(TypedDict, total=False):
    """The keyword arguments of ``WriterOptions`` (and of a writer, which also takes None
    for ``chunk_bytes`` and ``join_seconds``: their tunables default), each optional."""

    storage_options: Mapping[str, Any] | None
    keep_last: int | None
    keep_every: int | None
    keep_best: int | None
    best_metric: str | None
    best_mode: Literal["min", "max"]
    retention: RetentionPolicy | None
    max_pending: int
    max_concurrency: int
    background_niceness: int
    newer_steps: NewerSteps
    process_group: Any
    incremental: bool
    staging: StagingMode
    service: str | os.PathLike[str] | None
    buffer_pool: BufferPool | None
    chunk_bytes: int
    join_seconds: float
    replicas: int


@dataclass(frozen=True, kw_only=True)
class WriterOptions:
    """Every option of a checkpoint writer, checked when made (InvalidArgumentError).

    ``storage_options`` reach the root (fsspec; copied). ``keep_last``/``keep_every``/
    ``keep_best`` with ``best_metric``/``best_mode`` are the retention rules (see
    RetentionPolicy), or pass ``retention=RetentionPolicy(...)`` instead (not both);
    ``policy`` is the one in effect. ``max_pending`` snapshots may exist at once (each
    one staging buffer, reused); ``max_concurrency`` files of a save are written at
    once; ``background_niceness`` (Linux, CheckpointWriter only) lowers the CPU
    priority of the writer's threads, so training steps keep the cores while a save
    is in flight and the save takes longer.

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
    ``checkpointd.LOCAL`` makes this process save alone. ``join_seconds`` (default
    ``tunables.JOIN_SECONDS``): how long the ranks wait for a live rank that has not
    made the same writer, or called ``save()`` for the same step, before failing.

    ``incremental``: a tensor of at least ``tunables.INCREMENTAL_MIN_BYTES`` (its value
    when the writer was made, in this process, also through the service) whose bytes
    equal one of the writer's previous committed checkpoint is not written again: the
    manifest references the stored bytes (a shared blob, by XXH3-128 digest; see
    incremental.py and docs/format.md). Every checkpoint still loads whole on its own;
    retention and gc delete a blob only when no committed manifest uses it; with many
    ranks each rank's shards are blobs of their own.

    ``staging``: ``"blocking"`` (default) copies the whole state into host memory
    before ``save()`` returns. ``"overlapped"`` copies the parameters of the
    optimizers in the state and those optimizers' state tensors in the background
    while training goes on (a step pre-hook on each such optimizer waits for the
    copy, so ``optimizer.step()`` cannot change them mid-copy); every other tensor
    (buffers such as BatchNorm statistics, EMA weights, user tensors) is copied
    before ``save()`` returns. Only ``optimizer.step()`` is guarded: change those
    tensors any other way only after ``wait_staged()``. See staging.py.

    ``service``: None (default) writes in this process, in a background thread.
    ``"auto"`` or a socket path (made a str) writes through the checkpoint service
    (README, "The checkpoint service"): ``save()`` captures into the service's shared
    memory and returns once the service owns the snapshot, which then commits even
    if this process dies; with many ranks each rank's service runs that rank's part of
    the commit (ranks/hosted.py). With ``incremental=True`` the service references
    unchanged tensors (the same files), but every tensor is copied into its memory at
    ``save()``. With ``staging="overlapped"`` the snapshot is handed to the service
    when its copy ends (from ``handle.staged()`` on, it commits whatever happens here).

    ``buffer_pool``: a BufferPool that several writers share, one after another: the
    writer takes its staging buffers from it and gives them back once closed (the
    Lightning plugin's writers, one per root). Not with ``service=``.

    ``chunk_bytes`` (default ``tunables.CHUNK_BYTES``): bytes handed to storage per
    write while a file or blob streams (the service's writer uses it too).

    The tunables defaults are read when the options are made.
    """

    storage_options: Mapping[str, Any] | None = None
    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: Literal["min", "max"] = "min"
    retention: RetentionPolicy | None = None
    max_pending: int = tunables.DEFAULT_MAX_PENDING
    max_concurrency: int = tunables.DEFAULT_MAX_CONCURRENCY
    background_niceness: int = 0
    newer_steps: NewerSteps = "error"
    process_group: Any = None
    incremental: bool = False
    staging: StagingMode = "blocking"
    service: str | os.PathLike[str] | None = None
    buffer_pool: BufferPool | None = None
    chunk_bytes: int = field(default_factory=lambda: tunables.CHUNK_BYTES)
    join_seconds: float = field(default_factory=lambda: tunables.JOIN_SECONDS)
    replicas: int = 0
    """With ``service=`` in a many-rank job: each rank's held share of a save is also
    held by the services of this many other nodes of the job (daemon/server/replicas.py)."""
    policy: RetentionPolicy = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        options = self.storage_options
        if options is not None:
            if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
                raise InvalidArgumentError(
                    f"storage_options must be a mapping with str keys or None, not {options!r}"
                )
            object.__setattr__(self, "storage_options", dict(options))
        for name in ("max_pending", "max_concurrency", "chunk_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, not {value!r}")
        seconds = self.join_seconds
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
            raise InvalidArgumentError(
                f"join_seconds must be a positive number of seconds, not {seconds!r}"
            )
        niceness = self.background_niceness
        if isinstance(niceness, bool) or niceness not in range(20):
            raise InvalidArgumentError(
                f"background_niceness must be an int from 0 to 19, not {niceness!r}"
            )
        if niceness and not sys.platform.startswith("linux"):
            raise InvalidArgumentError("background_niceness needs Linux (per-thread priorities)")
        if not isinstance(self.incremental, bool):
            raise InvalidArgumentError(f"incremental must be a bool, not {self.incremental!r}")
        if self.newer_steps not in NEWER_STEPS:
            raise InvalidArgumentError(
                f"newer_steps must be one of {NEWER_STEPS}, not {self.newer_steps!r}"
            )
        if self.staging not in STAGING_MODES:
            raise InvalidArgumentError(
                f"staging must be one of {STAGING_MODES}, not {self.staging!r}"
            )
        if self.service is not None:
            if not isinstance(self.service, str | os.PathLike):
                raise InvalidArgumentError(
                    f'service must be None, "auto" or a socket path, not {self.service!r}'
                )
            object.__setattr__(self, "service", os.fspath(self.service))
        replicas = self.replicas
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise InvalidArgumentError(f"replicas must be an int of 0 or more, not {replicas!r}")
        if replicas and self.service is None:
            raise InvalidArgumentError("replicas= needs service= (peers hold the service's copies)")
        if self.buffer_pool is not None and not isinstance(self.buffer_pool, BufferPool):
            raise InvalidArgumentError(
                f"buffer_pool must be a BufferPool or None, not {type(self.buffer_pool).__qualname__}"
            )
        object.__setattr__(self, "policy", self._policy())

    def _policy(self) -> RetentionPolicy:
        """The retention in effect: ``retention``, or the loose keywords' (never both)."""
        loose = RetentionPolicy(
            self.keep_last, self.keep_every, self.keep_best, self.best_metric, self.best_mode
        )
        if self.retention is None:
            return loose
        if not isinstance(self.retention, RetentionPolicy):
            raise InvalidArgumentError(
                f"retention must be a RetentionPolicy, not {type(self.retention).__qualname__}"
            )
        if loose != RetentionPolicy():
            raise InvalidArgumentError(
                f"pass retention=RetentionPolicy(...) or {'/'.join(_RETENTION_KEYWORDS)}, not both"
            )
        return self.retention

    @property
    def service_path(self) -> str | None:
        """``service`` as a str ("auto" or a socket path), or None: write in-process."""
        return None if self.service is None else os.fspath(self.service)

    def keywords(self) -> WriterKeywords:
        """The keywords that make a writer with these options."""
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        return cast(WriterKeywords, given)

    def replace(self, **changes: Any) -> WriterOptions:
        """These options with ``changes``, checked again."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, slots=True)
class SaveTarget:
    """What every save of one writer means, fixed when the writer is made: the root
    resolved in the trainer (``storage.resolve_root``: an absolute path or a normalised
    URL, so a service in another working folder names the same place), its storage
    options (a copy) and the layout tunables (``SaveLayout.now()`` then).

    Both backends use this one value: the in-process one opens its store from it and
    stamps each snapshot with its layout; the service backend sends it once, in
    ``OpenWriter``, and the service stamps the snapshots it rebuilds with it. So a
    tunable changed after the writer was made does not apply to that writer (nor to
    any process that hosts it); a writer made after the change uses it. Any thread."""

    root: str
    storage_options: dict[str, Any] | None
    layout: SaveLayout

    @classmethod
    def of(cls, root: str | os.PathLike[str], options: WriterOptions) -> SaveTarget:
        """The target of a writer of ``root`` with ``options``, the tunables read now;
        InvalidArgumentError if they are out of range (``SaveLayout.check``)."""
        layout = SaveLayout.now()
        layout.check()
        given = options.storage_options
        return cls(resolve_root(root), None if given is None else dict(given), layout)
