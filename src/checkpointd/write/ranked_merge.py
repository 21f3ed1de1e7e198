"""The publisher's merge: every rank's share of a many-rank save in one manifest.

What each rank posts once its files are durable (``Share``), how the publisher
makes the one manifest of them (``merged_manifest``), and the ``Summary`` the other
ranks read instead of that manifest (its size does not grow with the ranks). Below
``tunables.SHARD_INDEX_MIN_ENTRIES`` the shares carry their shard entries and the
merge is linear in ranks x sharded tensors; above it each rank writes its entries to
a shard index file (``shard_index``) and posts only per-component checks of them
(``indexed_share``), so the merge is linear in ranks + sharded tensors. Pure
functions of posted values; any thread.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import msgspec

from checkpointd.errors import RankFailedError
from checkpointd.format.checksum import crc32c
from checkpointd.format.layout import shard_index_name
from checkpointd.format.manifest import (
    BlobEntry,
    CheckpointInfo,
    ComponentEntry,
    FileEntry,
    Manifest,
    ShardedTensor,
    ShardEntry,
    shard_problem,
)
from checkpointd.format.shard_index import ShardIndex, encode_index, uses_indexes
from checkpointd.maintain.retention import WriterIdentity
from checkpointd.ranks.group import Group, rank_key
from checkpointd.write.commit import manifest_of
from checkpointd.write.items import RankFile
from checkpointd.write.plan import SavePlan

__all__ = [
    "Share",
    "Summary",
    "indexed",
    "indexed_share",
    "merged_manifest",
    "shard_index",
    "written_shards",
]


class Share(msgspec.Struct, frozen=True):
    """What a rank posts once its files are durable: their entries, and the components
    only it has (its per-rank ones) with the per-rank names they stand for."""

    files: list[FileEntry]
    components: dict[str, ComponentEntry]
    per_rank: dict[str, str]
    sharded: dict[str, dict[str, ShardedTensor]] = msgspec.field(default_factory=dict)
    """Per replicated component, its sharded tensors with the shards this rank wrote
    (``written_shards``: only the tensors it wrote, its non-empty shards)."""
    blobs: list[BlobEntry] = msgspec.field(default_factory=list)
    """The shared blobs this rank wrote or checked (incremental saves)."""
    index: str = ""
    """Its shard index file (one of ``files``), when its entries are there, not in
    ``sharded``; "" if it wrote none (no shards, or they are inline)."""
    layout: dict[str, int] = msgspec.field(default_factory=dict)
    """With indexes: per replicated component with sharded tensors, the CRC32C of their
    names, dtypes and global shapes (``layout_digests``), the same on every rank."""
    elements: dict[str, int] = msgspec.field(default_factory=dict)
    """With indexes: per replicated component, the elements of the shards it wrote."""


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


def indexed(plan: SavePlan, world_size: int) -> bool:
    """Whether this save's ranks store their shard entries in index files (the same
    answer on every rank of a save whose ranks agree on its DTensors)."""
    count = sum(len(e.sharded) for n, e in plan.components.items() if n not in plan.per_rank)
    return uses_indexes(world_size, count, plan.layout.shard_index_min)


def shard_index(
    plan: SavePlan, group: Group, number: int, sharded: Mapping[str, Mapping[str, ShardedTensor]]
) -> RankFile | None:
    """The shard index file this rank writes with its files (attempt ``number``), holding
    ``sharded`` (``written_shards``), or None: inline entries, or no shard written here."""
    if not sharded or not indexed(plan, group.world_size):
        return None
    index = ShardIndex(
        plan.step,
        group.rank,
        {c: {t: s.shards for t, s in tensors.items()} for c, tensors in sharded.items()},
    )
    name = shard_index_name(f"{group.token}{number}", group.rank)
    return RankFile(name, [encode_index(index)], "", group.rank)


def layout_digests(plan: SavePlan) -> dict[str, int]:
    """Per replicated component with sharded tensors, the CRC32C of their names, dtypes
    and global shapes: what every rank of the save must agree on."""
    return {
        name: crc32c(
            msgspec.json.encode(sorted((t, s.dtype, s.shape) for t, s in e.sharded.items()))
        )
        for name, e in plan.components.items()
        if e.sharded and name not in plan.per_rank
    }


def indexed_share(share: Share, plan: SavePlan, index: str) -> Share:
    """``share`` as posted when its shard entries are in ``index`` (its file, or "" if it
    wrote no shard): instead of the entries, the checks the publisher makes of them."""
    elements = {
        name: sum(math.prod(s.shape) for t in tensors.values() for s in t.shards)
        for name, tensors in share.sharded.items()
    }
    return msgspec.structs.replace(
        share, sharded={}, index=index, layout=layout_digests(plan), elements=elements
    )


def merged_manifest(
    plan: SavePlan, world_size: int, shares: list[Share], identity: WriterIdentity | None
) -> Manifest:
    """The one manifest of a many-rank save: every rank's files and per-rank components,
    sharded tensors merged, or their shards counted where the ranks wrote shard indexes
    (RankFailedError unless they tile them, or add up to them, and every rank agrees on
    each DTensor). ``shares`` by rank."""
    files = [entry for share in shares for entry in share.files]
    _check_indexed(plan, shares)
    blobs: dict[str, BlobEntry] = {}
    for share in shares:  # a blob two ranks hold (a shard equal to a replica) is listed once
        for blob in share.blobs:
            if blob.name not in blobs or blob.written:
                blobs[blob.name] = blob
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
        blobs.values(),
        identity=identity,
        components=components,
        world_size=world_size,
        per_rank=per_rank,
        shard_indexes=[share.index for share in shares if share.index],
    )


def _check_indexed(plan: SavePlan, shares: list[Share]) -> None:
    """RankFailedError unless every share posted with indexes agrees on the DTensors of
    each component and their shards' elements add up to those DTensors' (the shards'
    boxes are in the indexes, which the reader checks for tiling). Linear in the ranks
    and the components."""
    mine = layout_digests(plan)
    counted = [bool(share.layout or share.elements or share.index) for share in shares]
    if not any(counted):
        return
    for share in (share for share, with_index in zip(shares, counted, strict=True) if with_index):
        if share.layout != mine:
            differs = sorted(set(share.layout.items()) ^ set(mine.items()))
            raise RankFailedError(
                f"the save of step {plan.step} failed: ranks disagree on the DTensors of "
                f"component {differs[0][0]!r} (their names, dtypes and global shapes must be "
                "the same on every rank)"
            )
    for name, entry in plan.components.items():
        if name not in mine:
            continue
        total = sum(
            share.elements.get(name, 0)
            if with_index
            else sum(
                math.prod(s.shape) for t in share.sharded.get(name, {}).values() for s in t.shards
            )
            for share, with_index in zip(shares, counted, strict=True)
        )
        expected = sum(math.prod(t.shape) for t in entry.sharded.values())
        if total != expected:
            raise RankFailedError(
                f"the save of step {plan.step} failed: the ranks' shards of component "
                f"{name!r} hold {total} elements, its DTensors {expected}; every rank must "
                "save the same DTensors"
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
    whole = not any(share.index for share in shares)  # else the rest is in the indexes
    merged: dict[str, ShardedTensor] = {}
    for tensor, mine in entry.sharded.items():
        merged[tensor] = ShardedTensor(mine.dtype, mine.shape, gathered[tensor])
        if problem := shard_problem(merged[tensor], whole=whole):
            raise RankFailedError(
                f"the save of step {step} failed: the shards of DTensor {name}/{tensor} do not "
                f"tile it ({problem}); every rank must save the same DTensors"
            )
    return msgspec.structs.replace(entry, sharded=merged)
