"""What a save writes: the plan that turns a captured snapshot into files.

The plan knows components, trees and the safetensors layout; the commit
protocol (commit.py) knows none of that: it streams, commits and publishes
whatever files a plan lists, and records the plan's component entries in the
manifest. Made in a worker thread of the writer's event loop (headers, the
msgpack trees and shard block CRC32Cs are computed here; tensor bytes stay in
the staging buffer).

Seam for later issues: ``PlannedFile`` is the union of what a manifest entry
can come from. Today it is only ``WriteFile`` (bytes this process writes now).
Many ranks add "a file another rank writes" (its ``FileEntry`` arrives from
that rank before the publish) and incremental saves add "a file already
stored" (its ``FileEntry`` is copied from an earlier manifest, nothing is
written); both join the union and ``commit.commit_plan`` gains one branch per
kind, while ``plan_snapshot`` decides which kind each file is.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeAlias

from checkpointd import tunables
from checkpointd.format.checksum import BytesLike, crc32c
from checkpointd.format.codec import encode_tree
from checkpointd.format.dtypes import encode_dtype
from checkpointd.format.header import encode_safetensors_header
from checkpointd.format.layout import (
    DIRECT_ALIGN,
    HEADER_ALIGN,
    shard_file_name,
    tensor_file_name,
    tree_file_name,
)
from checkpointd.format.manifest import (
    BlobEntry,
    ComponentEntry,
    ShardedTensor,
    ShardEntry,
    SpecEntry,
)
from checkpointd.write.capture import CapturedComponent, StagingBuffer

__all__ = ["PlannedFile", "SavePlan", "Snapshot", "WriteFile", "plan_shards", "plan_snapshot"]


@dataclass(slots=True)
class Snapshot:
    """Everything one save needs after capture; owned by the writer until it resolves."""

    step: int
    components: list[CapturedComponent]
    buffer: StagingBuffer
    created_at: datetime
    metrics: dict[str, Any]
    metadata: dict[str, Any]
    specs: dict[str, SpecEntry] = field(default_factory=dict)
    attempt: int = 0
    """This writer's attempt number at ``step`` (0 first); names a many-rank save's keys."""
    per_rank: dict[str, str] = field(default_factory=dict)
    """Components that hold this rank's own state -> the per-rank component's name."""
    rank: int = 0
    """This process's rank in the group that saves (0 alone); names its shard files."""


@dataclass(frozen=True, slots=True)
class WriteFile:
    """A file this process writes: ``parts`` concatenated, under ``name`` in the step folder.

    ``component`` is the component it belongs to (for messages), ``rank`` the rank
    that writes it (recorded in the manifest; ranks.commit.assign_ranks sets it).
    ``own``: the file holds this rank's shards, so this rank writes it and no other
    rank has a copy to compare it with.
    """

    name: str
    parts: Sequence[BytesLike]
    component: str
    rank: int = 0
    own: bool = False

    @property
    def size(self) -> int:
        """Bytes the file will hold."""
        return sum(memoryview(part).nbytes for part in self.parts)


PlannedFile: TypeAlias = WriteFile
"""One file a manifest will list; see the module docstring for the kinds to come."""


@dataclass(frozen=True, slots=True)
class SavePlan:
    """Every file of one save attempt, and the manifest fields that are not about files."""

    step: int
    files: list[PlannedFile]
    components: dict[str, ComponentEntry]
    created_at: datetime
    metrics: dict[str, Any]
    metadata: dict[str, Any]
    specs: dict[str, SpecEntry] = field(default_factory=dict)
    per_rank: dict[str, str] = field(default_factory=dict)
    """As ``Snapshot.per_rank``: these components are this rank's alone."""
    blobs: list[BlobEntry] = field(default_factory=list)
    """Shared blobs the manifest lists (incremental saves: incremental.py writes them
    before the commit; ``commit_plan`` only records them)."""

    @classmethod
    def of(
        cls,
        snapshot: Snapshot,
        files: list[PlannedFile],
        components: dict[str, ComponentEntry],
        blobs: list[BlobEntry] | None = None,
    ) -> SavePlan:
        """The plan of ``snapshot`` with these files and component entries (and, for an
        incremental save, these shared blobs); the other fields come from the snapshot."""
        return cls(
            step=snapshot.step,
            files=files,
            components=components,
            created_at=snapshot.created_at,
            metrics=snapshot.metrics,
            metadata=snapshot.metadata,
            specs=snapshot.specs,
            per_rank=snapshot.per_rank,
            blobs=blobs or [],
        )


def plan_snapshot(snapshot: Snapshot, token: str | None = None) -> SavePlan:
    """The files that store ``snapshot``: per component a tree file and, if it has
    tensors, a tensor file, named for the attempt ``token`` (random if None).

    A data region of tunables.DIRECT_MIN_BYTES or more starts DIRECT_ALIGN-aligned in its
    file, so it can be written with direct I/O. Event loop or any thread.
    """
    token = secrets.token_hex(4) if token is None else token
    files: list[PlannedFile] = []
    components: dict[str, ComponentEntry] = {}
    for component in snapshot.components:
        name = component.name
        tree = tree_file_name(name, token)
        files.append(WriteFile(tree, [encode_tree(component.tree)], name))
        tensor_names: list[str] = []
        if component.entries:
            tensors = tensor_file_name(name, token)
            tensor_names.append(tensors)
            align = DIRECT_ALIGN if component.nbytes >= tunables.DIRECT_MIN_BYTES else HEADER_ALIGN
            header = encode_safetensors_header(component.entries, align=align)
            data = snapshot.buffer.view(component.offset, component.nbytes)
            files.append(WriteFile(tensors, [header, data], name))
        sharded = plan_shards(component, snapshot, token, files)
        components[name] = ComponentEntry(
            tree=tree,
            tensors=tensor_names,
            nbytes=component.nbytes,
            num_tensors=len(component.entries),
            sharded=sharded,
        )
    return SavePlan.of(snapshot, files, components)


def plan_shards(
    component: CapturedComponent, snapshot: Snapshot, token: str, files: list[PlannedFile]
) -> dict[str, ShardedTensor]:
    """An entry per sharded tensor of ``component`` listing the shards this rank writes,
    whose file (if it writes any) is appended to ``files``; the publisher of a many-rank
    save merges every rank's entries. Block CRC32Cs are computed here: call it off the
    loop. Used by full and incremental saves alike."""
    buffer, rank = snapshot.buffer, snapshot.rank
    sharded = {
        s.name: ShardedTensor(encode_dtype(s.dtype, "name"), list(s.shape), [])
        for s in component.shards
    }
    if not component.shard_entries:
        return sharded
    name = shard_file_name(component.name, token, rank)
    align = DIRECT_ALIGN if component.shard_nbytes >= tunables.DIRECT_MIN_BYTES else HEADER_ALIGN
    header = encode_safetensors_header(component.shard_entries, align=align)
    data = buffer.view(component.shard_offset, component.shard_nbytes)
    by_name = {s.name: s for s in component.shards}
    for entry in component.shard_entries:
        shard = by_name[entry.name]
        region = data[entry.begin : entry.end]
        blocks = [
            crc32c(region[at : at + tunables.SHARD_BLOCK_BYTES])
            for at in range(0, len(region), tunables.SHARD_BLOCK_BYTES)
        ]
        sharded[entry.name].shards.append(
            ShardEntry(
                name,
                list(shard.offsets),
                list(shard.local_shape),
                len(header) + entry.begin,
                tunables.SHARD_BLOCK_BYTES,
                blocks,
            )
        )
    files.append(WriteFile(name, [header, data], component.name, rank, own=True))
    return sharded
