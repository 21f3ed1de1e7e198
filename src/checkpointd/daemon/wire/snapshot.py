"""A snapshot and its description: the trainer describes what it captured into a segment,
the service rebuilds the very ``plan.Snapshot`` an in-process save would write.

The trees travel encoded (``codec.encode_tree``) and come back as ``msgspec.Raw``,
which the plan's ``encode_tree`` writes out byte for byte: the files are the same
as an in-process save's, planned with the trainer's tunables (its writer's
``SaveLayout``, sent once in ``OpenWriter``), not the service's. Every offset, size and name is checked against the
segment before the service trusts it (held.py: what the memory tier keeps of a
committed save). The CRC32Cs capture took as it copied (``ComponentDesc.crcs``) are
the trainer's word, as the bytes are: one that does not match its bytes makes a file
every reader refuses, never a checkpoint read wrong. Imports torch.
"""

from __future__ import annotations

import math

import msgspec
import torch

from checkpointd import tunables
from checkpointd.daemon.wire.protocol import (
    ComponentDesc,
    EntryDesc,
    ProtocolError,
    ShardDesc,
    SnapshotDesc,
)
from checkpointd.errors import CheckpointError, UnsupportedValueError
from checkpointd.format.codec import encode_tree
from checkpointd.format.dtypes import decode_dtype, encode_dtype
from checkpointd.format.header import TensorEntry
from checkpointd.format.layout import SaveLayout, check_component_name
from checkpointd.write.capture import CapturedComponent, CapturedShard, StagingBuffer
from checkpointd.write.plan import Snapshot

__all__ = ["describe", "rebuild"]


def describe(snapshot: Snapshot) -> SnapshotDesc:
    """The description of a captured ``snapshot`` (caller thread, inside ``save()``):
    everything the plan reads of it, DTensor shards included, but the segment's bytes.

    UnsupportedValueError for incremental references (the trainer's capture never makes
    them: the service's writer finds unchanged tensors itself)."""
    components: list[ComponentDesc] = []
    for component in snapshot.components:
        if component.blobs:
            raise UnsupportedValueError(
                f"component {component.name!r} holds incremental references: the checkpoint "
                "service finds unchanged tensors itself (use service=None)"
            )
        shards = [
            ShardDesc(
                s.name,
                encode_dtype(s.dtype, "code"),
                list(s.shape),
                list(s.offsets),
                list(s.local_shape),
                s.written,
            )
            for s in component.shards
        ]
        components.append(
            ComponentDesc(
                component.name,
                encode_tree(component.tree),
                [_entry_desc(e) for e in component.entries],
                component.offset,
                component.nbytes,
                shards,
                [_entry_desc(e) for e in component.shard_entries],
                component.shard_offset,
                component.shard_nbytes,
                component.crcs,
            )
        )
    return SnapshotDesc(
        step=snapshot.step,
        created_at=snapshot.created_at,
        components=components,
        metrics=snapshot.metrics,
        metadata=snapshot.metadata,
        specs=snapshot.specs,
        per_rank=snapshot.per_rank,
        attempt=snapshot.attempt,
        rank=snapshot.rank,
    )


def _entry_desc(entry: TensorEntry) -> EntryDesc:
    return EntryDesc(
        entry.name, encode_dtype(entry.dtype, "code"), list(entry.shape), entry.begin, entry.end
    )


def rebuild(desc: SnapshotDesc, arena: torch.Tensor, layout: SaveLayout) -> Snapshot:
    """The Snapshot ``desc`` describes, over ``arena`` (the segment, as uint8), laid out
    by ``layout`` (its writer's, checked when the writer opened).

    ProtocolError where the description does not fit the segment or names a
    dtype, a component or a shape no capture could have made, or holds more shard
    blocks than a manifest can list."""
    size = arena.numel()
    components: list[CapturedComponent] = []
    seen: set[str] = set()
    for comp in desc.components:
        try:
            check_component_name(comp.name)
        except CheckpointError as exc:
            raise ProtocolError(str(exc)) from None
        if comp.name in seen:
            raise ProtocolError(f"component {comp.name!r} is described twice")
        seen.add(comp.name)
        _region(comp.name, "data", comp.offset, comp.nbytes, size)
        _region(comp.name, "shard", comp.shard_offset, comp.shard_nbytes, size)
        entries = [_entry(e, comp.name, comp.nbytes) for e in comp.entries]
        shards = _shards(comp)
        shard_entries = [_entry(e, comp.name, comp.shard_nbytes) for e in comp.shard_entries]
        _check_written(comp.name, shards, shard_entries)
        _check_crcs(comp)
        components.append(
            CapturedComponent(
                comp.name,
                msgspec.Raw(comp.tree),
                entries,
                comp.offset,
                comp.nbytes,
                shards,
                shard_entries,
                comp.shard_offset,
                comp.shard_nbytes,
                crcs=list(comp.crcs),
            )
        )
    _check_block(layout.shard_block, components)
    return Snapshot(
        desc.step,
        components,
        StagingBuffer.over(arena),
        desc.created_at,
        dict(desc.metrics),
        dict(desc.metadata),
        specs=dict(desc.specs),
        per_rank=dict(desc.per_rank),
        attempt=desc.attempt,
        rank=desc.rank,
        layout=layout,
    )


def _check_block(block: int, components: list[CapturedComponent]) -> None:
    """A shard block size (at least one byte: SaveLayout.check) whose block CRC32Cs (two
    bytes each at the least) fit the manifest or shard index no reader refuses."""
    blocks = sum(-(-(e.end - e.begin) // block) for c in components for e in c.shard_entries)
    if blocks > tunables.MAX_MANIFEST_BYTES // 2:
        raise ProtocolError(
            f"{blocks:,} shard blocks of {block} bytes: their CRC32Cs cannot fit the "
            f"{tunables.MAX_MANIFEST_BYTES:,}-byte manifest any reader accepts"
        )


def _check_crcs(comp: ComponentDesc) -> None:
    """The CRC32Cs capture took: none, or one per tensor entry, each 32 bits (or None)."""
    if comp.crcs and len(comp.crcs) != len(comp.entries):
        raise ProtocolError(
            f"component {comp.name!r} has {len(comp.crcs)} CRC32Cs for {len(comp.entries)} tensors"
        )
    if any(crc is not None and not 0 <= crc < 1 << 32 for crc in comp.crcs):
        raise ProtocolError(f"component {comp.name!r} has a CRC32C out of range")


def _region(component: str, what: str, offset: int, nbytes: int, size: int) -> None:
    if nbytes < 0 or not 0 <= offset <= offset + nbytes <= size:
        raise ProtocolError(
            f"the {what} region of component {component!r} spans bytes {offset}.."
            f"{offset + nbytes} of a {size}-byte segment"
        )


def _dtype(code: str, name: str) -> torch.dtype:
    dtype = decode_dtype(code)
    if dtype is None:
        raise ProtocolError(f"tensor {name!r} has unknown dtype {code!r}")
    return dtype


def _entry(entry: EntryDesc, component: str, nbytes: int) -> TensorEntry:
    """The tensor entry ``entry`` describes, checked to lie in its region of ``nbytes``."""
    dtype = _dtype(entry.dtype, entry.name)
    if any(d < 0 for d in entry.shape):
        raise ProtocolError(f"tensor {entry.name!r} has a negative dimension")
    expected = math.prod(entry.shape) * dtype.itemsize
    if not 0 <= entry.begin <= entry.end <= nbytes or entry.end - entry.begin != expected:
        raise ProtocolError(
            f"tensor {entry.name!r} of component {component!r} does not fit its region"
        )
    return TensorEntry(entry.name, dtype, tuple(entry.shape), entry.begin, entry.end)


def _shards(comp: ComponentDesc) -> list[CapturedShard]:
    """The component's DTensors, each shard checked to lie inside its global shape."""
    shards: list[CapturedShard] = []
    names: set[str] = set()
    for s in comp.shards:
        dims = len(s.shape)
        if s.name in names:
            raise ProtocolError(f"DTensor {s.name!r} of {comp.name!r} is described twice")
        names.add(s.name)
        if (
            len(s.offsets) != dims
            or len(s.local_shape) != dims
            or not all(
                o >= 0 and n >= 0 and o + n <= g
                for o, n, g in zip(s.offsets, s.local_shape, s.shape, strict=True)
            )
        ):
            raise ProtocolError(
                f"DTensor {s.name!r} of {comp.name!r}: shard at {s.offsets} of shape "
                f"{s.local_shape} does not lie inside shape {s.shape}"
            )
        dtype = _dtype(s.dtype, s.name)
        shards.append(
            CapturedShard(
                s.name, dtype, tuple(s.shape), tuple(s.offsets), tuple(s.local_shape), s.written
            )
        )
    return shards


def _check_written(component: str, shards: list[CapturedShard], entries: list[TensorEntry]) -> None:
    """Every shard this rank writes has exactly one entry of its dtype and local shape in
    the shard region, and no entry names anything else (the plan relies on both)."""
    written = {s.name: s for s in shards if s.written}
    named = [e.name for e in entries]
    if sorted(named) != sorted(written):
        raise ProtocolError(
            f"component {component!r}: the shard region's tensors do not match the DTensors "
            "this rank writes"
        )
    for entry in entries:
        shard = written[entry.name]
        if entry.dtype != shard.dtype or entry.shape != shard.local_shape:
            raise ProtocolError(
                f"DTensor {entry.name!r} of {component!r}: its region holds another dtype or shape"
            )
