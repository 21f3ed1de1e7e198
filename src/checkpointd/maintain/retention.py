"""Retention: which committed checkpoints to keep, and deleting the others.

Deciding is pure (``plan_retention`` over a list of CheckpointInfo); executing
is ``apply_retention``, which the writer runs only after a commit, through
deletion.py's ``delete_checkpoints``, which removes each checkpoint manifest first so
that a half-deleted checkpoint is invisible, never torn (also used by ``gc`` and by
``newer_steps="discard"``); retention re-exports it and ``delete_checkpoint``.

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
exception to the exception: a writer whose process restored a checkpoint of the
root before the writer's first commit continues that checkpoint's lineage
(lineage.py) and treats the lineage's checkpoints up to the restored step as its own.

Damage: only checkpoints that check out count for a rule; a writer checks the step
it just committed for presence, gc reads every counted step whole (soundness.py).
"""

from __future__ import annotations

import functools
import logging
import math
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import anyio.to_thread

from checkpointd import tunables
from checkpointd.errors import InvalidArgumentError, RetentionWarning, StorageError
from checkpointd.format.layout import MANIFEST_NAME, step_dirname
from checkpointd.format.manifest import CheckpointInfo, Manifest
from checkpointd.maintain.deletion import delete_checkpoint, delete_checkpoints
from checkpointd.maintain.soundness import Checked, checked_plan, present, verified
from checkpointd.read.catalog import committed as committed_manifests
from checkpointd.read.catalog import step_path
from checkpointd.read.lineage import WriterIdentity
from checkpointd.storage import Store
from checkpointd.storage.base import shown

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

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """Keep a checkpoint if any rule keeps it; the newest one is always kept.

    With no rule set, nothing is ever deleted.

    Attributes:
        keep_last: Keep the newest N.
        keep_every: Keep steps divisible by K.
        keep_best: Keep the K best by ``metrics[best_metric]``.
        best_metric: The metrics key ``keep_best`` ranks by (required with it).
        best_mode: "min" or "max": which values are best.

    Raises:
        InvalidArgumentError: A rule is not a positive int or None, ``keep_best`` has
            no ``best_metric``, or ``best_mode`` is neither "min" nor "max".
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
    "every", "best", "protected", "damaged"); ``delete`` is what no rule keeps,
    oldest first; ``unranked`` are steps the best-metric rule could not rank.
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
    damaged: Iterable[int] = (),
) -> RetentionPlan:
    """Apply ``policy`` to ``checkpoints`` (committed ones, any order); pure, never warns.

    The newest step and the ``protect`` steps present are always kept. With no
    rule set, everything is kept. ``foreign`` maps steps that another writer
    committed to when it committed them (Unix seconds); those committed less
    than ``grace`` seconds (default tunables.GRACE_SECONDS) before ``now`` (Unix
    seconds, required with ``foreign``) are kept too ("other writer").
    ``damaged`` steps (found not to check out, soundness.py) count for no rule: the
    rules pick among the others (the newest sound step is kept as "newest"), and a
    damaged step is kept ("damaged") only where the plan without ``damaged`` keeps it.
    """
    bad = set(damaged)
    if bad:
        kwargs: dict[str, Any] = {"protect": protect, "foreign": foreign, "now": now}
        whole = plan_retention(checkpoints, policy, grace=grace, **kwargs)
        sound = [c for c in checkpoints if c.step not in bad]
        plan = plan_retention(sound, policy, grace=grace, **kwargs)
        kept = dict(plan.reasons)
        kept.update((s, ("damaged",)) for s in whole.reasons if s in bad)
        return RetentionPlan(
            reasons=dict(sorted(kept.items())),
            delete=tuple(c for c in whole.delete if c.step not in kept),
            unranked=plan.unranked,
        )
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


def _damaged_warning(checked: Checked) -> str:
    """The RetentionWarning message for the damaged steps a checked plan found."""
    lines = [f"step {s} does not check out ({why})" for s, why in sorted(checked.damaged.items())]
    if checked.refused:
        return "; ".join(lines) + ": no checkpoint checks out, so retention deletes none"
    others = [s for s in checked.plan.reasons if s not in checked.damaged]
    kept = f"; keeping step {max(others)} in its place" if others else ""
    return "; ".join(lines) + ": it counts for no retention rule" + kept


def _rules(policy: RetentionPolicy) -> str:
    """The rules ``policy`` sets, as a log line shows them (``keep_last=2``)."""
    rules = [f"{n}={getattr(policy, n)}" for n in ("keep_last", "keep_every", "keep_best")]
    best = f" by {policy.best_mode} {policy.best_metric}" if policy.keep_best else ""
    return ", ".join(r for r in rules if not r.endswith("=None")) + best


def _unranked_warning(steps: Sequence[int], policy: RetentionPolicy) -> str:
    """The RetentionWarning message for ``steps`` that lack the best metric."""
    return (
        f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))} "
        f"{'have' if len(steps) > 1 else 'has'} no numeric metric {policy.best_metric!r}: "
        "keep_best cannot rank it; only keep_last/keep_every (or being newest) keep it"
    )


# ---------------------------------------------------------------------------
# Execution: blocking storage calls, from worker threads of the writer's loop
# (apply_retention); deleting is deletion.py's, from any thread.


def _committed_at(store: Store, step: int, manifest: Manifest) -> float:
    """When ``step`` was committed (Unix seconds).

    Its manifest's time where the store keeps one, and never earlier than its save was called.
    Worker thread.
    """
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
) -> tuple[Checked, dict[int, Manifest]]:
    """The checked plan for ``policy``, and the manifests read.

    As soundness.py checks: the step just committed, ``protect``, for presence, any other
    counted step read whole; another writer's fresh checkpoints are spared when
    ``identity`` is given. Worker thread.
    """
    found = committed_manifests(store, known=known)
    manifests = dict(found)
    checkpoints = [CheckpointInfo.from_manifest(m, step_path(store, s)) for s, m in found]
    plan = plan_retention(checkpoints, policy, protect=protect)
    extra: dict[str, Any] = {"protect": protect}
    if identity is not None and plan.delete:
        newest: dict[str, int] = {}
        for step, manifest in found:
            newest[manifest.writer] = max(step, newest.get(manifest.writer, step))
        foreign = {
            v.step: _committed_at(store, v.step, manifests[v.step])
            for v in plan.delete
            if not identity.owns(v.step, manifests[v.step], newest)
        }
        if foreign:
            extra.update(foreign=foreign, now=time.time(), grace=identity.grace())

    def check(step: int) -> str | None:
        if step in protect:  # just committed by this writer: see soundness.py
            return present(store, step, manifests[step])
        return verified(store, step, manifests[step])

    checked = checked_plan(
        lambda damaged: plan_retention(checkpoints, policy, damaged=damaged, **extra),
        check,
        every=False,
        first=protect[0] if protect else None,
    )
    return checked, manifests


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
    Before deleting anything, ``committed_step`` is checked for presence (its files
    and blobs at their sizes); if it fails, the step counted instead is verified whole,
    and so on (soundness.py): a step that does not check out counts for no rule, and
    if none checks out nothing is deleted. Warns (RetentionWarning) for such steps,
    and if ``committed_step`` lacks the best metric.
    ``known`` caches manifests across passes (see ``catalog.scan``).
    """
    if not policy.deletes_anything:
        return []
    protect = () if committed_step is None else (committed_step,)
    checked, manifests = await anyio.to_thread.run_sync(
        functools.partial(_plan, store, policy, protect, identity, known), limiter=limiter
    )
    if checked.damaged:
        warnings.warn(_damaged_warning(checked), RetentionWarning, stacklevel=2)
    victims = [v.step for v in checked.plan.delete]
    deleted: list[int] = []
    if victims:
        deleted = await anyio.to_thread.run_sync(
            delete_checkpoints, store, victims, manifests, known, limiter=limiter
        )
        if deleted:
            steps = ", ".join(map(str, deleted))
            _log.info(
                "retention deleted steps %s of %s (%s)", steps, shown(store.url), _rules(policy)
            )
    unranked = checked.plan.unranked
    if committed_step is not None and committed_step in unranked:
        # Only the new step: older unranked steps were reported when they were committed.
        warnings.warn(_unranked_warning([committed_step], policy), RetentionWarning, stacklevel=2)
    return deleted
