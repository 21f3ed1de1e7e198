"""Retention counts only checkpoints that check out, so it never leaves a root without one.

Before anything is deleted, the steps a plan counts on (the newest, ``keep_last``'s
and ``keep_best``'s picks) are checked, newest first. One that fails is kept but
counts for no rule (``plan_retention(damaged=...)``), and the plan is made again,
so an older step takes its place and is checked in turn. If no step checks out,
nothing is deleted. How much is checked depends on who deletes:

- ``gc`` reads every byte of every counted step (``read.verify.verify_step``): it
  runs seldom, on a root whose history it does not know, and it is the tool told
  to delete.
- A writer trusts the step it has just committed: the CRC32Cs in its manifest were
  computed from the very bytes it sent, and every file was acknowledged durable
  (fsync and rename, or an upload completed after the store checked each part's
  CRC32C). Reading it back after every save would double each save's I/O (and on
  a local disk would read the page cache, not the media). It checks only what can
  change after that acknowledgement without reading data: every file and shared
  blob is still there, at its size. Only if that fails does it read anything: the
  step it would count instead is verified whole before anything older goes.

Blocking; worker threads. Imports no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from checkpointd.errors import StorageError, StorageNotFoundError
from checkpointd.format.layout import blob_path, step_dirname
from checkpointd.format.manifest import Manifest
from checkpointd.read.verify import verify_step
from checkpointd.storage import Store

if TYPE_CHECKING:
    from checkpointd.maintain.retention import RetentionPlan

__all__ = ["COUNTED", "Check", "Checked", "checked_plan", "present", "verified"]

COUNTED = frozenset({"newest", "last", "best"})
"""The reasons that count a step toward a rule: only a step that checks out may hold one."""

Check = Callable[[int], "str | None"]
"""What is wrong with a step (a short line), or None if it checks out."""

Planner = Callable[[Mapping[int, str]], "RetentionPlan"]
"""The plan for the damaged steps found so far (``plan_retention(..., damaged=...)``)."""


@dataclass(frozen=True, slots=True)
class Checked:
    """A plan whose counted steps were checked before anything is deleted.

    ``damaged``: the steps that failed (what was wrong first), kept but not counted;
    ``sound``: the steps that checked out, in the order checked; ``refused``: no
    counted step checked out, so ``plan.delete`` is empty.
    """

    plan: RetentionPlan
    damaged: dict[int, str]
    sound: tuple[int, ...]
    refused: bool = False


def checked_plan(
    planner: Planner, check: Check, *, every: bool, first: int | None = None
) -> Checked:
    """The plan once its counted steps check out: with ``every``, each counted step
    (gc); without, only until one kept step does (a writer), ``first`` (the step it
    just committed) tried before the counted ones. A plan that deletes nothing is
    not checked at all."""
    damaged: dict[int, str] = {}
    sound: list[int] = []
    while True:
        plan = planner(damaged)
        if not plan.delete:
            return Checked(plan, damaged, tuple(sound))
        counted = [
            s
            for s in sorted(plan.reasons, reverse=True)
            if s not in damaged and COUNTED.intersection(plan.reasons[s])
        ]
        if first is not None and first in plan.reasons and first not in damaged:
            counted.insert(0, first)
        todo = [s for s in dict.fromkeys(counted) if s not in sound]
        holds = any(s in plan.reasons for s in sound)
        if holds and (not every or not todo):
            return Checked(plan, damaged, tuple(sound))
        if not todo:
            refused = dataclasses.replace(
                plan,
                reasons={**plan.reasons, **{v.step: ("nothing checks out",) for v in plan.delete}},
                delete=(),
            )
            return Checked(refused, damaged, tuple(sound), refused=True)
        step = todo[0]
        problem = check(step)
        if problem is None:
            sound.append(step)
        else:
            damaged[step] = problem


def present(store: Store, step: int, manifest: Manifest) -> str | None:
    """Whether every file and shared blob ``manifest`` lists is stored at its size
    (metadata only: one size call each); the first that is not, or None."""
    folder = step_dirname(step)
    listed = [(f"{folder}/{f.path}", f.size) for f in manifest.files]
    listed += [(blob_path(b.name), b.size) for b in manifest.blobs]
    where = store.url.rstrip("/")
    for path, size in listed:
        try:
            found = store.size(path)
        except StorageNotFoundError:
            return f"{where}/{path}: listed in the manifest but missing"
        except StorageError as exc:
            return f"{where}/{path}: {exc}"
        if found != size:
            return f"{where}/{path}: size {found} does not match the manifest's {size}"
    return None


def verified(
    store: Store,
    step: int,
    manifest: Manifest,
    seen: dict[tuple[str, int], str | None] | None = None,
) -> str | None:
    """Every byte of ``step`` read against ``manifest`` (``verify_step``; ``seen`` caches
    shared blobs): the first problem and how many more, or None."""
    try:
        bad = verify_step(store, step, manifest, seen=seen)
    except StorageError as exc:
        return str(exc)
    if not bad:
        return None
    return bad[0] + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
