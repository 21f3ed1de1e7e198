"""What a save writes: the plan that turns a captured snapshot into files and blobs.

The plan knows components, trees and the safetensors layout; the commit
protocol (commit.py, and write/ranked_commit.py for many ranks) knows none of that: it
writes, checks and publishes whatever items a plan lists (items.py: files and
blobs, each with the rank that makes it durable), and records the plan's
component entries in the manifest. Made in a worker thread of the writer's event
loop (headers, the msgpack trees and shard block CRC32Cs are computed here;
tensor bytes stay in the staging buffer).

``plan_snapshot`` decides the kind of every item, for a full save, a many-rank
save and an incremental one alike; which tensors go to blobs is decided before
(incremental.py hashes them) and handed in as ``Blobs``.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from checkpointd.format.checksum import BytesLike, crc32c, crc32c_combine
from checkpointd.format.codec import encode_tree
from checkpointd.format.dtypes import encode_dtype
from checkpointd.format.header import TensorEntry, encode_safetensors_header
from checkpointd.format.layout import (
    DIRECT_ALIGN,
    HEADER_ALIGN,
    SaveLayout,
    shard_file_name,
    tensor_file_name,
    tree_file_name,
)
from checkpointd.format.manifest import (
    BlobEntry,
    BlobRef,
    ComponentEntry,
    ShardedTensor,
    ShardEntry,
    SpecEntry,
)
from checkpointd.write.capture import CapturedComponent, StagingBuffer
from checkpointd.write.items import (
    KeepBlob,
    PlannedFile,
    RankFile,
    WriteBlob,
    WriteFile,
    assign_ranks,
)

__all__ = ["Blobs", "SavePlan", "Snapshot", "plan_snapshot"]


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
    layout: SaveLayout = field(default_factory=SaveLayout.now)
    """The tunables that decide its files, as they were when the snapshot was made, at
    ``save()`` (the service plans with the trainer's)."""


@dataclass(slots=True)
class Blobs:
    """What an incremental save decided before planning (incremental.py): the tensors of
    each component stored as blobs, and for each blob whether to write or keep it.

    ``refs[component][tensor]``: a whole tensor's blob; ``shards[component][tensor]``:
    the blob of this rank's shard of a DTensor. ``new[name]``: the bytes of a blob to
    write; ``kept[name]``: a stored blob to reference, with the snapshot's copy of its
    bytes if it has one. ``own``: blobs only this rank holds (its shards)."""

    refs: dict[str, dict[str, BlobRef]] = field(default_factory=dict)
    shards: dict[str, dict[str, str]] = field(default_factory=dict)
    new: dict[str, memoryview] = field(default_factory=dict)
    kept: dict[str, tuple[BlobEntry, memoryview | None]] = field(default_factory=dict)
    own: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class SavePlan:
    """Every item of one save attempt, and the manifest fields that are not about files."""

    step: int
    files: list[PlannedFile]
    components: dict[str, ComponentEntry]
    created_at: datetime
    metrics: dict[str, Any]
    metadata: dict[str, Any]
    specs: dict[str, SpecEntry] = field(default_factory=dict)
    per_rank: dict[str, str] = field(default_factory=dict)
    """As ``Snapshot.per_rank``: these components are this rank's alone."""
    layout: SaveLayout = field(default_factory=SaveLayout.now)
    """As ``Snapshot.layout`` (``write/ranked_merge.indexed`` reads its ``shard_index_min``)."""

    @classmethod
    def of(
        cls, snapshot: Snapshot, files: list[PlannedFile], components: dict[str, ComponentEntry]
    ) -> SavePlan:
        """The plan of ``snapshot`` with these items and component entries; the other
        fields come from the snapshot."""
        return cls(
            step=snapshot.step,
            files=files,
            components=components,
            created_at=snapshot.created_at,
            metrics=snapshot.metrics,
            metadata=snapshot.metadata,
            specs=snapshot.specs,
            per_rank=snapshot.per_rank,
            layout=snapshot.layout,
        )

    def mine(self, rank: int) -> list[PlannedFile]:
        """The items ``rank`` makes durable."""
        return [f for f in self.files if f.rank == rank]


def plan_snapshot(
    snapshot: Snapshot,
    token: str | None = None,
    *,
    world_size: int = 1,
    blobs: Blobs | None = None,
) -> SavePlan:
    """The items that store ``snapshot``, named for the attempt ``token`` (random if
    None), each with the rank of ``world_size`` that makes it durable: per component a
    tree file, a tensor file if it has tensors not stored as ``blobs``, this rank's
    shard file if it holds shards; then the blobs to write or keep.

    A data region of ``snapshot.layout.direct_min`` bytes or more starts DIRECT_ALIGN-aligned
    in its file, so it can be written with direct I/O. Any thread; off the event loop for a
    large state (shard block CRC32Cs are computed here).
    """
    token = secrets.token_hex(4) if token is None else token
    blobs = Blobs() if blobs is None else blobs
    files: list[PlannedFile] = []
    components: dict[str, ComponentEntry] = {}
    for component in snapshot.components:
        name = component.name
        own = name in snapshot.per_rank
        refs = blobs.refs.get(name, {})
        tree = tree_file_name(name, token)
        files.append(_step_file(own, tree, [encode_tree(component.tree)], name, snapshot.rank))
        tensor_names: list[str] = []
        parts = _tensor_parts(component, snapshot, refs)
        if parts is not None:
            tensors = tensor_file_name(name, token)
            tensor_names.append(tensors)
            files.append(_step_file(own, tensors, parts[0], name, snapshot.rank, crcs=parts[1]))
        components[name] = ComponentEntry(
            tree=tree,
            tensors=tensor_names,
            nbytes=component.nbytes,
            num_tensors=len(component.entries),
            sharded=_plan_shards(component, snapshot, token, files, blobs.shards.get(name, {})),
            refs=refs,
        )
    rank = snapshot.rank
    for blob, view in sorted(blobs.new.items()):
        files.append(WriteBlob(blob, [view], rank, own=blob in blobs.own))
    for blob, (entry, copy) in sorted(blobs.kept.items()):
        files.append(KeepBlob(entry, None if copy is None else [copy], rank, blob in blobs.own))
    return SavePlan.of(snapshot, assign_ranks(files, world_size), components)


def _step_file(
    own: bool,
    name: str,
    parts: list[BytesLike],
    component: str,
    rank: int,
    *,
    crcs: list[int | None] | tuple[()] = (),
) -> PlannedFile:
    if own:
        return RankFile(name, parts, component, rank, crcs)
    return WriteFile(name, parts, component, crcs=crcs)


def _tensor_parts(
    component: CapturedComponent, snapshot: Snapshot, refs: Mapping[str, BlobRef]
) -> tuple[list[BytesLike], list[int | None]] | None:
    """The parts of ``component``'s tensor file (header, then data), leaving out the
    tensors stored as blobs (``refs``), with the CRC32C capture took of each data part
    (None if it did not); None if no tensor is left."""
    buffer, direct_min = snapshot.buffer, snapshot.layout.direct_min
    known = component.crcs if len(component.crcs) == len(component.entries) else None
    if not refs:
        if not component.entries:
            return None
        data = buffer.view(component.offset, component.nbytes)
        crc = None if known is None else _joined(component.entries, known, data)
        return [_header(component.entries, component.nbytes, direct_min), data], [None, crc]
    small: list[TensorEntry] = []
    views: list[BytesLike] = []
    crcs: list[int | None] = [None]
    position = 0
    for at, entry in enumerate(component.entries):  # kept in order: decreasing element size
        if entry.name in refs:
            continue
        size = entry.end - entry.begin
        small.append(TensorEntry(entry.name, entry.dtype, entry.shape, position, position + size))
        views.append(buffer.view(component.offset + entry.begin, size))
        crcs.append(None if known is None else known[at])
        position += size
    return ([_header(small, position, direct_min), *views], crcs) if small else None


def _joined(entries: list[TensorEntry], crcs: list[int | None], data: BytesLike) -> int | None:
    """The CRC32C of the data region ``data`` from the CRC32Cs capture took of its tensors
    (``crcs``, None where it took none), the bytes between those tensors (smaller
    tensors, padding) checksummed here; None if capture took none (the writer then
    checksums the region as it writes it). Writer's thread."""
    view = memoryview(data).cast("B")
    digest, position = 0, 0
    for entry, crc in sorted(zip(entries, crcs, strict=True), key=lambda pair: pair[0].begin):
        if crc is None or entry.begin == entry.end:
            continue
        if entry.begin < position:  # overlapping entries: no layout capture makes
            return None
        digest = crc32c(view[position : entry.begin], digest)
        digest = crc32c_combine(digest, crc, entry.end - entry.begin)
        position = entry.end
    if position == 0:
        return None
    return crc32c(view[position:], digest)


def _header(entries: list[TensorEntry], nbytes: int, direct_min: int) -> bytes:
    align = DIRECT_ALIGN if nbytes >= direct_min else HEADER_ALIGN
    return encode_safetensors_header(entries, align=align)


def _plan_shards(
    component: CapturedComponent,
    snapshot: Snapshot,
    token: str,
    files: list[PlannedFile],
    blobs: Mapping[str, str],
) -> dict[str, ShardedTensor]:
    """An entry per sharded tensor of ``component`` listing the shards this rank writes,
    each in this rank's shard file (appended to ``files`` if it holds any) or, named in
    ``blobs``, as a shared blob; the publisher of a many-rank save merges every rank's
    entries. Block CRC32Cs are computed here."""
    buffer, rank = snapshot.buffer, snapshot.rank
    sharded = {
        s.name: ShardedTensor(encode_dtype(s.dtype, "name"), list(s.shape), [])
        for s in component.shards
    }
    if not component.shard_entries:
        return sharded
    name = shard_file_name(component.name, token, rank)
    data = buffer.view(component.shard_offset, component.shard_nbytes)
    kept = [e for e in component.shard_entries if e.name not in blobs]
    parts: list[BytesLike] = [data[e.begin : e.end] for e in kept]
    entries, position = [], 0
    for entry in kept:
        size = entry.end - entry.begin
        entries.append(TensorEntry(entry.name, entry.dtype, entry.shape, position, position + size))
        position += size
    header = _header(entries, position, snapshot.layout.direct_min) if entries else b""
    begins = {entry.name: len(header) + entry.begin for entry in entries}
    by_name = {s.name: s for s in component.shards}
    for entry in component.shard_entries:
        shard = by_name[entry.name]
        blob = blobs.get(entry.name, "")
        sharded[entry.name].shards.append(
            ShardEntry(
                "" if blob else name,
                list(shard.offsets),
                list(shard.local_shape),
                begins.get(entry.name, 0),
                snapshot.layout.shard_block,
                _blocks(data[entry.begin : entry.end], snapshot.layout.shard_block),
                blob,
            )
        )
    if entries:
        whole = len(entries) == len(component.shard_entries)
        files.append(
            RankFile(name, [header, data] if whole else [header, *parts], component.name, rank)
        )
    return sharded


def _blocks(region: memoryview, step: int) -> list[int]:
    return [crc32c(region[at : at + step]) for at in range(0, len(region), step)]
