"""``checkpointd gc`` as a library: what retention and leftover cleanup would remove, and doing it.

Blocking; any thread. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from checkpointd import catalog
from checkpointd.cleanup import Leftover, remove_leftovers, scan_leftovers
from checkpointd.manifest import CheckpointInfo
from checkpointd.retention import (
    RetentionPlan,
    RetentionPolicy,
    delete_checkpoints,
    plan_retention,
)
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
    checkpoint_bytes: int | None = None
    """Bytes deleting the checkpoints frees: their own files and the shared blobs only
    they use (None: the sum of their sizes, as without shared blobs)."""

    @property
    def freed(self) -> int:
        """Bytes that applying the plan removes."""
        own = self.checkpoint_bytes
        if own is None:
            own = sum(v.nbytes for v in self.retention.delete)
        return own + sum(x.nbytes for x in self.leftovers)


def plan_gc(store: Store, policy: RetentionPolicy, *, older_than: float) -> GcPlan:
    """Plan a collection: reads every manifest, lists leftovers untouched ``older_than`` s."""
    found = catalog.committed(store)
    checkpoints = [CheckpointInfo.from_manifest(m, catalog.step_path(store, s)) for s, m in found]
    scan = scan_leftovers(store, older_than=older_than)
    retention = plan_retention(checkpoints, policy)
    doomed = {v.step for v in retention.delete}
    kept = {b.name for s, m in found if s not in doomed for b in m.blobs}
    dropped = {(b.name, b.size) for s, m in found if s in doomed for b in m.blobs}
    files = sum(f.size for s, m in found if s in doomed for f in m.files)
    freed = files + sum(size for name, size in dropped if name not in kept)
    return GcPlan(checkpoints, retention, scan.leftovers, scan.problems, freed)


def apply_gc(store: Store, plan: GcPlan) -> None:
    """Delete what ``plan`` lists: checkpoints oldest first (each manifest first), then the
    shared blobs only they used, then leftovers."""
    delete_checkpoints(store, [victim.step for victim in plan.retention.delete])
    remove_leftovers(store, plan.leftovers)
