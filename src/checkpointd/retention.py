"""Retention: which committed checkpoints to keep, as pure functions over their list.

The writer applies the policy only after a commit, deleting each victim's
manifest first so that a half-deleted checkpoint is invisible, never torn.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from checkpointd.manifest import CheckpointInfo

__all__ = ["RetentionPolicy", "RetentionWarning", "checkpoints_to_delete", "checkpoints_to_keep"]


class RetentionWarning(UserWarning):
    """A checkpoint could not be ranked by the best-metric rule."""


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
                raise ValueError(f"{name} must be a positive int or None, not {value!r}")
        if self.keep_best is not None and not self.best_metric:
            raise ValueError("keep_best needs best_metric (the metrics key to rank by)")
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', not {self.best_mode!r}")

    @property
    def deletes_anything(self) -> bool:
        """True if some rule is set, so checkpoints outside the rules are deleted."""
        return any(v is not None for v in (self.keep_last, self.keep_every, self.keep_best))


def checkpoints_to_keep(checkpoints: Sequence[CheckpointInfo], policy: RetentionPolicy) -> set[int]:
    """The steps the policy keeps among ``checkpoints`` (any order)."""
    if not checkpoints:
        return set()
    by_step = sorted(checkpoints, key=lambda c: c.step)
    if not policy.deletes_anything:
        return {c.step for c in by_step}
    kept = {by_step[-1].step}
    if policy.keep_last is not None:
        kept.update(c.step for c in by_step[-policy.keep_last :])
    if policy.keep_every is not None:
        kept.update(c.step for c in by_step if c.step % policy.keep_every == 0)
    if policy.keep_best is not None:
        kept.update(_best_steps(by_step, policy))
    return kept


def _best_steps(checkpoints: Sequence[CheckpointInfo], policy: RetentionPolicy) -> list[int]:
    assert policy.best_metric is not None
    assert policy.keep_best is not None
    ranked: list[tuple[float, int]] = []
    unranked: list[int] = []
    for checkpoint in checkpoints:
        value = checkpoint.metrics.get(policy.best_metric)
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            unranked.append(checkpoint.step)
            continue
        ranked.append((value if policy.best_mode == "min" else -value, checkpoint.step))
    if unranked:
        warnings.warn(
            f"steps {unranked} have no numeric metric {policy.best_metric!r}; "
            "only keep_last/keep_every can keep them",
            RetentionWarning,
            stacklevel=3,
        )
    ranked.sort()
    return [step for _, step in ranked[: policy.keep_best]]


def checkpoints_to_delete(
    checkpoints: Sequence[CheckpointInfo], policy: RetentionPolicy
) -> list[CheckpointInfo]:
    """The checkpoints the policy drops, oldest first; never the newest."""
    kept = checkpoints_to_keep(checkpoints, policy)
    return sorted((c for c in checkpoints if c.step not in kept), key=lambda c: c.step)
