"""``checkpointd gc`` as a library: what retention and leftover cleanup would remove, and doing it.

Blocking; any thread. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from checkpointd import catalog
from checkpointd.cleanup import Leftover, remove_leftovers, scan_leftovers
from checkpointd.manifest import CheckpointInfo
from checkpointd.retention import RetentionPlan, RetentionPolicy, delete_checkpoint, plan_retention
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

    @property
    def freed(self) -> int:
        """Bytes that applying the plan removes."""
        return sum(v.nbytes for v in self.retention.delete) + sum(x.nbytes for x in self.leftovers)


def plan_gc(store: Store, policy: RetentionPolicy, *, older_than: float) -> GcPlan:
    """Plan a collection: reads every manifest, lists leftovers untouched ``older_than`` s."""
    checkpoints = catalog.infos(store)
    scan = scan_leftovers(store, older_than=older_than)
    return GcPlan(checkpoints, plan_retention(checkpoints, policy), scan.leftovers, scan.problems)


def apply_gc(store: Store, plan: GcPlan) -> None:
    """Delete what ``plan`` lists: checkpoints oldest first (each manifest first), then leftovers."""
    for victim in plan.retention.delete:
        delete_checkpoint(store, victim.step)
    remove_leftovers(store, plan.leftovers)
