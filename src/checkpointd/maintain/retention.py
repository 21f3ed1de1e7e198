"""Retention: which committed checkpoints to keep, and deleting the others.

Deciding is pure (``plan_retention`` over a list of CheckpointInfo); executing
is ``apply_retention``, which the writer runs only after a commit, and
``delete_checkpoint``, which removes one checkpoint manifest first so that a
half-deleted checkpoint is invisible, never torn (also used by ``gc`` and by
``newer_steps="discard"``).

Sharing a root: several writers (two jobs, a restarted job and its old
instance, a trainer and a side job) may save into one root. Steps are shared:
two saves of one step race and exactly one commits. Each writer applies its
own policy to every committed checkpoint in the root, whoever wrote it, with
one exception: it never deletes a checkpoint that another writer instance
committed less than a grace window ago (the longer of ``tunables.GRACE_SECONDS`` and
twice its own last save interval), so a save another writer just reported
durable stays loadable for at least that long. Each manifest records the
random id of the writer instance that committed it (``Manifest.writer``); a
manifest without one counts as another writer's. A restarted job is the
exception to the exception: a writer opened after this process restored a
checkpoint of the root continues that checkpoint's lineage (lineage.py) and
treats the lineage's checkpoints up to the restored step as its own.
"""

from __future__ import annotations

import functools
import math
import secrets
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import anyio
import anyio.to_thread

from checkpointd import tunables
from checkpointd.errors import InvalidArgumentError, RetentionWarning, StorageError
from checkpointd.format.layout import MANIFEST_NAME, step_dirname
from checkpointd.format.manifest import CheckpointInfo, Manifest
from checkpointd.maintain.lineage import lineage_of, resumed_from
from checkpointd.read.catalog import committed as committed_manifests
from checkpointd.read.catalog import step_path
from checkpointd.storage import Store

__all__ = [
    "RetentionPlan",
    "RetentionPolicy",
    "RetentionWarning",
    "WriterIdentity",
    "apply_retention",
    "delete_checkpoint",
    "delete_checkpoints",
    "plan_retention",
]


@dataclass(slots=True)
class WriterIdentity:
    """One writer instance: the random id its manifests carry, and its save interval.

    Used only from the writer's event loop (one save at a time).
    """

    id: str = field(default_factory=lambda: secrets.token_hex(8))
    lineage: str = ""
    """The lineage its manifests record (lineage.py): its own id, or a resumed one's."""
    inherited: int | None = None
    """The step it resumed from: its lineage's checkpoints up to it count as its own."""
    last_commit: float | None = None
    """When this writer last committed (time.monotonic())."""
    interval: float | None = None
    """Seconds between its last two commits."""
    root: str = ""
    """The root it writes ("": none known), whose restores ``follow_resume`` picks up."""

    def __post_init__(self) -> None:
        self.lineage = self.lineage or self.id

    @classmethod
    def for_root(cls, url: str) -> WriterIdentity:
        """A new identity for a writer of root ``url``: continuing the lineage of the
        checkpoint this process restored from it, if any (lineage.py)."""
        identity = cls(root=url)
        identity.follow_resume()
        return identity

    def follow_resume(self) -> None:
        """Before this writer's first commit: continue the lineage of the checkpoint this
        process restored from its root last, also when the restore came after the writer
        was made (``writer.restore``, accelerate's ``load_state(accelerator, writer)``).
        After its first commit the lineage its manifests record stays. Writer's loop."""
        if self.last_commit is not None or not self.root:
            return
        resumed = resumed_from(self.root)
        if resumed is not None:
            self.lineage, self.inherited = resumed.lineage, resumed.step

    def owns(self, step: int, manifest: Manifest, newest: Mapping[str, int]) -> bool:
        """True if checkpoint ``step`` is this writer's to prune without a grace window:
        its own, or its lineage's up to the inherited step from an instance that has
        committed nothing after it (``newest``: each writer id's newest step)."""
        if manifest.writer == self.id:
            return True
        if self.inherited is None or step > self.inherited:
            return False
        if lineage_of(manifest) != self.lineage:
            return False
        return newest.get(manifest.writer, step) <= self.inherited

    def note_commit(self, now: float) -> None:
        """Record a commit at ``now`` (monotonic seconds)."""
        if self.last_commit is not None:
            self.interval = max(0.0, now - self.last_commit)
        self.last_commit = now

    def grace(self) -> float:
        """How long another writer's checkpoint is kept after its commit: tunables.GRACE_SECONDS or
        twice this writer's last save interval, whichever is longer."""
        return max(tunables.GRACE_SECONDS, 2 * (self.interval or 0.0))


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """Keep a checkpoint if any rule keeps it; the newest one is always kept.

    ``keep_last``: the newest N. ``keep_every``: steps divisible by K.
    ``keep_best``: the K best by ``metrics[best_metric]`` (``best_mode`` "min" or "max").
    With no rule set, nothing is ever deleted.
    """

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every", "keep_best"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise InvalidArgumentError(f"{name} must be a positive int or None, not {value!r}")
        if self.keep_best is not None and not self.best_metric:
            raise InvalidArgumentError("keep_best needs best_metric (the metrics key to rank by)")
        if self.best_mode not in ("min", "max"):
            raise InvalidArgumentError(f"best_mode must be 'min' or 'max', not {self.best_mode!r}")

    @property
    def deletes_anything(self) -> bool:
        """True if some rule is set, so checkpoints outside the rules are deleted."""
        return any(v is not None for v in (self.keep_last, self.keep_every, self.keep_best))


@dataclass(frozen=True, slots=True)
class RetentionPlan:
    """What a policy does to a list of committed checkpoints.

    ``reasons[step]`` names the rules that keep ``step`` ("newest", "last",
    "every", "best", "protected"); ``delete`` is what no rule keeps, oldest
    first; ``unranked`` are steps the best-metric rule could not rank.
    """

    reasons: dict[int, tuple[str, ...]]
    delete: tuple[CheckpointInfo, ...]
    unranked: tuple[int, ...]

    @property
    def keep(self) -> set[int]:
        """The steps kept."""
        return set(self.reasons)


def plan_retention(
    checkpoints: Sequence[CheckpointInfo],
    policy: RetentionPolicy,
    *,
    protect: Iterable[int] = (),
    foreign: Mapping[int, float] | None = None,
    now: float | None = None,
    grace: float | None = None,
) -> RetentionPlan:
    """Apply ``policy`` to ``checkpoints`` (committed ones, any order); pure, never warns.

    The newest step and the ``protect`` steps present are always kept. With no
    rule set, everything is kept. ``foreign`` maps steps that another writer
    committed to when it committed them (Unix seconds); those committed less
    than ``grace`` seconds (default tunables.GRACE_SECONDS) before ``now`` (Unix
    seconds, required with ``foreign``) are kept too ("other writer").
    """
    if foreign and now is None:
        raise InvalidArgumentError("plan_retention: pass now with foreign")
    grace = tunables.GRACE_SECONDS if grace is None else grace
    by_step = sorted(checkpoints, key=lambda c: c.step)
    reasons: dict[int, list[str]] = {}

    def keep(steps: Iterable[int], reason: str) -> None:
        for step in steps:
            reasons.setdefault(step, []).append(reason)

    unranked: list[int] = []
    if by_step:
        keep([by_step[-1].step], "newest")
        present = {c.step for c in by_step}
        keep(sorted(present.intersection(protect)), "protected")
        if not policy.deletes_anything:
            keep(sorted(present), "no rule")
        if policy.keep_last is not None:
            keep((c.step for c in by_step[-policy.keep_last :]), "last")
        if policy.keep_every is not None:
            keep((c.step for c in by_step if c.step % policy.keep_every == 0), "every")
        if policy.keep_best is not None:
            best, unranked = _best_steps(by_step, policy)
            keep(best, "best")
        if foreign and now is not None:
            keep(
                sorted(s for s, at in foreign.items() if s in present and now - at < grace),
                "other writer",
            )
    return RetentionPlan(
        reasons={step: tuple(why) for step, why in sorted(reasons.items())},
        delete=tuple(c for c in by_step if c.step not in reasons),
        unranked=tuple(unranked),
    )


def _best_steps(
    checkpoints: Sequence[CheckpointInfo], policy: RetentionPolicy
) -> tuple[list[int], list[int]]:
    """The ``keep_best`` best steps, and the steps without a numeric metric to rank."""
    assert policy.best_metric is not None
    assert policy.keep_best is not None
    ranked: list[tuple[float, int]] = []
    unranked: list[int] = []
    for checkpoint in checkpoints:
        value = checkpoint.metrics.get(policy.best_metric)
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            unranked.append(checkpoint.step)
            continue
        # Ties go to the newer step: it carries more training for the same score.
        ranked.append((value if policy.best_mode == "min" else -value, -checkpoint.step))
    ranked.sort()
    return [-neg_step for _, neg_step in ranked[: policy.keep_best]], unranked


def _unranked_warning(steps: Sequence[int], policy: RetentionPolicy) -> str:
    """The RetentionWarning message for ``steps`` that lack the best metric."""
    return (
        f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))} "
        f"{'have' if len(steps) > 1 else 'has'} no numeric metric {policy.best_metric!r}: "
        "keep_best cannot rank it; only keep_last/keep_every (or being newest) keep it"
    )


# ---------------------------------------------------------------------------
# Execution: blocking storage calls, from worker threads of the writer's loop
# (apply_retention) or from any thread (delete_checkpoint).


def delete_checkpoint(store: Store, step: int) -> bool:
    """Remove the committed checkpoint ``step``: its manifest first, so it is never seen
    half-deleted. Returns False (and touches nothing) if ``step`` has no manifest: its
    folder may be a save in flight, which only gc may remove once it is old.

    Once the manifest is gone the folder is not a checkpoint: if removing the
    rest fails or the process dies, what is left is a leftover for gc, which no
    reader lists or loads. Raises StorageError if the storage fails. Blocking;
    any thread.
    """
    folder = step_dirname(step)
    manifest = f"{folder}/{MANIFEST_NAME}"
    if not store.exists(manifest):
        return False
    store.remove_file(manifest)
    store.remove_dir(folder)
    return True


def delete_checkpoints(
    store: Store,
    steps: Iterable[int],
    manifests: Mapping[int, Manifest] | None = None,
    known: dict[int, Manifest] | None = None,
) -> list[int]:
    """``delete_checkpoint`` each of ``steps`` in order, then the shared blobs that only
    they used (shared.drop_blobs: after their manifests are gone, so a crash midway
    loses nothing a committed checkpoint needs). ``manifests``: those already read;
    ``known``: a manifest cache (catalog.scan).
    Returns the steps deleted. Blocking; any thread.
    """
    from checkpointd.errors import CheckpointError
    from checkpointd.maintain.blobs import drop_blobs
    from checkpointd.read.catalog import read_manifest

    deleted: list[int] = []
    dropped: list[Manifest] = []
    for step in steps:
        manifest = (manifests or {}).get(step)
        if manifest is None:
            try:
                manifest = read_manifest(store, step)
            except CheckpointError:
                manifest = None  # unreadable: its blobs, if any, are left to gc
        if delete_checkpoint(store, step):
            deleted.append(step)
            if manifest is not None:
                dropped.append(manifest)
    drop_blobs(store, dropped, known)
    return deleted


def _committed_at(store: Store, step: int, manifest: Manifest) -> float:
    """When ``step`` was committed (Unix seconds): its manifest's time where the store
    keeps one, and never earlier than its save was called. Worker thread."""
    created = manifest.created_at.timestamp()
    try:
        modified = store.modified(f"{step_dirname(step)}/{MANIFEST_NAME}")
    except StorageError:
        modified = None
    return created if modified is None else max(created, modified)


def _plan(
    store: Store,
    policy: RetentionPolicy,
    protect: tuple[int, ...],
    identity: WriterIdentity | None,
    known: dict[int, Manifest] | None,
) -> tuple[list[int], tuple[int, ...], dict[int, Manifest]]:
    """(steps to delete, unranked steps, the manifests read) for ``policy``, sparing another
    writer's fresh checkpoints when ``identity`` is given. Worker thread."""
    found = committed_manifests(store, known=known)
    checkpoints = [CheckpointInfo.from_manifest(m, step_path(store, s)) for s, m in found]
    plan = plan_retention(checkpoints, policy, protect=protect)
    if identity is not None and plan.delete:
        manifests = dict(found)
        newest: dict[str, int] = {}
        for step, manifest in found:
            newest[manifest.writer] = max(step, newest.get(manifest.writer, step))
        foreign = {
            v.step: _committed_at(store, v.step, manifests[v.step])
            for v in plan.delete
            if not identity.owns(v.step, manifests[v.step], newest)
        }
        if foreign:
            plan = plan_retention(
                checkpoints,
                policy,
                protect=protect,
                foreign=foreign,
                now=time.time(),
                grace=identity.grace(),
            )
    return [v.step for v in plan.delete], plan.unranked, dict(found)


async def apply_retention(
    store: Store,
    policy: RetentionPolicy,
    limiter: anyio.CapacityLimiter,
    *,
    committed_step: int | None = None,
    identity: WriterIdentity | None = None,
    known: dict[int, Manifest] | None = None,
) -> list[int]:
    """Delete the committed checkpoints ``policy`` drops; return their steps, oldest first.

    Call only after a commit, with that commit's step. Only committed checkpoints
    are considered: a save still in flight has no manifest, so it is neither
    counted nor touched, and the newest committed checkpoint (and
    ``committed_step``) is never deleted, so a durable checkpoint always remains.
    With ``identity`` (the writer's), checkpoints another writer committed within
    ``identity.grace()`` seconds are kept too (see retention's module docstring).
    Warns (RetentionWarning) if ``committed_step`` lacks the best metric.
    ``known`` caches manifests across passes (see ``catalog.scan``).
    """
    if not policy.deletes_anything:
        return []
    protect = () if committed_step is None else (committed_step,)
    victims, unranked, manifests = await anyio.to_thread.run_sync(
        functools.partial(_plan, store, policy, protect, identity, known), limiter=limiter
    )
    deleted: list[int] = []
    if victims:
        deleted = await anyio.to_thread.run_sync(
            delete_checkpoints, store, victims, manifests, known, limiter=limiter
        )
    if committed_step is not None and committed_step in unranked:
        # Only the new step: older unranked steps were reported when they were committed.
        warnings.warn(_unranked_warning([committed_step], policy), RetentionWarning, stacklevel=2)
    return deleted
