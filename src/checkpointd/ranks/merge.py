"""The publisher's merge: every rank's share of a many-rank save in one manifest.

What each rank posts once its files are durable (``Share``), how the publisher
makes the one manifest of them (``merged_manifest``: linear in ranks x sharded
tensors), and the ``Summary`` the other ranks read instead of that manifest (its
size does not grow with the ranks). Pure functions of posted values; any thread.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import msgspec

from checkpointd.errors import RankFailedError
from checkpointd.format.manifest import (
    CheckpointInfo,
    ComponentEntry,
    FileEntry,
    Manifest,
    ShardedTensor,
    ShardEntry,
    shard_problem,
)
from checkpointd.maintain.retention import WriterIdentity
from checkpointd.ranks.group import rank_key
from checkpointd.write.commit import manifest_of
from checkpointd.write.plan import SavePlan

__all__ = ["Share", "Summary", "merged_manifest", "written_shards"]


class Share(msgspec.Struct, frozen=True):
    """What a rank posts once its files are durable: their entries, and the components
    only it has (its per-rank ones) with the per-rank names they stand for."""

    files: list[FileEntry]
    components: dict[str, ComponentEntry]
    per_rank: dict[str, str]
    sharded: dict[str, dict[str, ShardedTensor]] = msgspec.field(default_factory=dict)
    """Per replicated component, its sharded tensors with the shards this rank wrote
    (``written_shards``: only the tensors it wrote, its non-empty shards)."""


class Summary(msgspec.Struct, frozen=True):
    """What the ranks that do not publish need of the manifest for their CheckpointInfo,
    in a size that does not grow with the ranks: ``info`` lists the components but the
    per-rank ones, whose names (``per_rank``) are expanded by rule (``rank_key``)."""

    info: CheckpointInfo
    per_rank: list[str]

    @classmethod
    def of(cls, manifest: Manifest) -> Summary:
        """The summary of ``manifest`` (the publisher's, before it is published)."""
        ranked = {key for keys in manifest.per_rank.values() for key in keys}
        info = CheckpointInfo.from_manifest(manifest, "")
        shared = tuple(c for c in info.components if c not in ranked)
        return cls(msgspec.structs.replace(info, components=shared), list(manifest.per_rank))

    def at(self, path: str, world_size: int) -> CheckpointInfo:
        """The CheckpointInfo of the checkpoint at ``path``, saved by ``world_size`` ranks
        (the components in the manifest's order: the shared ones, then each rank's)."""
        ranked = tuple(rank_key(n, r) for r in range(world_size) for n in self.per_rank)
        return msgspec.structs.replace(
            self.info, path=path, components=self.info.components + ranked
        )


def merged_manifest(
    plan: SavePlan, world_size: int, shares: list[Share], identity: WriterIdentity | None
) -> Manifest:
    """The one manifest of a many-rank save: every rank's files and per-rank components,
    sharded tensors merged (RankFailedError unless their shards tile them)."""
    files = [entry for share in shares for entry in share.files]
    components = {
        name: _merge_shards(plan.step, name, entry, shares)
        for name, entry in plan.components.items()
        if name not in plan.per_rank
    }
    per_rank: dict[str, list[str]] = {}
    for share in shares:
        components.update(share.components)
        for key, name in share.per_rank.items():
            per_rank.setdefault(name, []).append(key)
    return manifest_of(
        plan,
        files,
        identity=identity,
        components=components,
        world_size=world_size,
        per_rank=per_rank,
    )


def written_shards(
    components: Mapping[str, ComponentEntry], per_rank: Mapping[str, str]
) -> dict[str, dict[str, ShardedTensor]]:
    """What a rank posts of its sharded tensors: per replicated component, the tensors it
    wrote shards of, without its empty shards (the shards other replicas write and the
    empty tail chunks of small tensors would grow every post with the job)."""
    posted: dict[str, dict[str, ShardedTensor]] = {}
    for name, entry in components.items():
        if name in per_rank:
            continue
        for tensor, sharded in entry.sharded.items():
            shards = [s for s in sharded.shards if math.prod(s.shape)]
            if shards:
                posted.setdefault(name, {})[tensor] = ShardedTensor(
                    sharded.dtype, sharded.shape, shards
                )
    return posted


def _merge_shards(
    step: int, name: str, entry: ComponentEntry, shares: list[Share]
) -> ComponentEntry:
    """``entry`` with the shards every rank wrote of its sharded tensors; raises
    RankFailedError unless they tile each tensor exactly (ranks that disagree on a
    DTensor's shape or placements). Linear in the shards posted and the ranks."""
    if not entry.sharded:
        return entry
    gathered: dict[str, list[ShardEntry]] = {tensor: [] for tensor in entry.sharded}
    for share in shares:
        for tensor, theirs in share.sharded.get(name, {}).items():
            mine = entry.sharded.get(tensor)
            if mine is None or (theirs.dtype, theirs.shape) != (mine.dtype, mine.shape):
                raise RankFailedError(
                    f"the save of step {step} failed: ranks disagree on DTensor "
                    f"{name}/{tensor} (its dtype and global shape must be the same on every rank)"
                )
            gathered[tensor] += theirs.shards
    merged: dict[str, ShardedTensor] = {}
    for tensor, mine in entry.sharded.items():
        merged[tensor] = ShardedTensor(mine.dtype, mine.shape, gathered[tensor])
        if problem := shard_problem(merged[tensor]):
            raise RankFailedError(
                f"the save of step {step} failed: the shards of DTensor {name}/{tensor} do not "
                f"tile it ({problem}); every rank must save the same DTensors"
            )
    return msgspec.structs.replace(entry, sharded=merged)
