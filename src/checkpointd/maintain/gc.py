"""``checkpointd gc`` as a library: what retention and leftover cleanup would remove, and doing it.

Before a plan deletes any checkpoint, every step it counts on (the newest,
``--keep-last``'s and ``--keep-best``'s picks) is read whole against its manifest;
one that fails is kept but not counted, so an older one that verifies takes its
place (soundness.py), and if none verifies no checkpoint is deleted.
Blocking; any thread. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from checkpointd.format.manifest import CheckpointInfo
from checkpointd.maintain.cleanup import Leftover, remove_leftovers, scan_leftovers
from checkpointd.maintain.deletion import delete_checkpoints
from checkpointd.maintain.retention import (
    RetentionPlan,
    RetentionPolicy,
    plan_retention,
)
from checkpointd.maintain.soundness import checked_plan, verified
from checkpointd.read import catalog
from checkpointd.storage import Store

__all__ = ["GcPlan", "apply_gc", "plan_gc"]


@dataclass(frozen=True, slots=True)
class GcPlan:
    """The committed checkpoints, what the policy does to them, and the leftovers found.

    ``problems`` has one line for each place the leftover scan could not list.
    """

    checkpoints: list[CheckpointInfo]
    retention: RetentionPlan
    leftovers: list[Leftover]
    problems: list[str]
    frees: dict[int, int] | None = None
    """Bytes deleting each doomed step frees: its own files and the shared blobs no
    other committed step uses (None: each step's size, as without shared blobs)."""
    shared_frees: int = 0
    """Bytes of shared blobs that only doomed steps use, several of them: freed too,
    and counted in no step's ``frees``."""
    damaged: dict[int, str] = field(default_factory=dict)
    """Counted steps that failed verification (what was wrong first): kept, not counted."""
    verified: tuple[int, ...] = ()
    """Steps read whole and found intact before deciding, in the order checked."""
    refused: bool = False
    """No counted step verified: the plan deletes no checkpoint."""

    def step_frees(self, step: int) -> int:
        """Bytes deleting doomed ``step`` frees (see ``frees``)."""
        if self.frees is not None:
            return self.frees[step]
        return next(v.nbytes for v in self.retention.delete if v.step == step)

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes deleting the doomed checkpoints frees: the sum of ``step_frees`` and
        ``shared_frees``."""
        own = sum(self.step_frees(v.step) for v in self.retention.delete)
        return own + self.shared_frees

    @property
    def freed(self) -> int:
        """Bytes that applying the plan removes: ``checkpoint_bytes`` and the leftovers."""
        return self.checkpoint_bytes + sum(x.nbytes for x in self.leftovers)


def plan_gc(store: Store, policy: RetentionPolicy, *, older_than: float) -> GcPlan:
    """Plan a collection: reads every manifest, lists leftovers untouched ``older_than`` s,
    and, if the plan deletes a checkpoint, verifies every step it counts on first."""
    found = catalog.committed(store)
    manifests = dict(found)
    checkpoints = [CheckpointInfo.from_manifest(m, catalog.step_path(store, s)) for s, m in found]
    scan = scan_leftovers(store, older_than=older_than)
    seen: dict[tuple[str, int], str | None] = {}  # a shared blob is read once
    checked = checked_plan(
        lambda damaged: plan_retention(checkpoints, policy, damaged=damaged),
        lambda step: verified(store, step, manifests[step], seen),
        every=True,
    )
    retention = checked.plan
    doomed = {v.step for v in retention.delete}
    kept = {b.name for s, m in found if s not in doomed for b in m.blobs}
    users: dict[str, set[int]] = {}
    sizes: dict[str, int] = {}
    for step, manifest in found:
        if step in doomed:
            for blob in manifest.blobs:
                users.setdefault(blob.name, set()).add(step)
                sizes[blob.name] = blob.size
    frees = {s: sum(f.size for f in m.files) for s, m in found if s in doomed}
    shared = 0
    for name, steps in users.items():
        if name in kept:
            continue
        if len(steps) == 1:
            frees[next(iter(steps))] += sizes[name]
        else:
            shared += sizes[name]
    return GcPlan(
        checkpoints,
        retention,
        scan.leftovers,
        scan.problems,
        frees,
        shared,
        damaged=checked.damaged,
        verified=checked.sound,
        refused=checked.refused,
    )


def apply_gc(store: Store, plan: GcPlan) -> None:
    """Delete what ``plan`` lists: checkpoints oldest first (each manifest first), then the
    shared blobs only they used, then leftovers."""
    delete_checkpoints(store, [victim.step for victim in plan.retention.delete])
    remove_leftovers(store, plan.leftovers)
