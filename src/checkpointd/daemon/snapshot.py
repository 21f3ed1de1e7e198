"""A snapshot and its description: the trainer describes what it captured into a segment,
the service rebuilds the very ``plan.Snapshot`` an in-process save would write.

The trees travel encoded (``codec.encode_tree``) and come back as ``msgspec.Raw``,
which the plan's ``encode_tree`` writes out byte for byte: the files are the same
as an in-process save's. Every offset, size and name is checked against the
segment before the service trusts it. ``held_checkpoint`` is what the memory tier
keeps of a committed save. Imports torch.
"""

from __future__ import annotations

import math

import msgspec
import torch

from checkpointd.errors import CheckpointError, InvalidArgumentError, UnsupportedValueError
from checkpointd.format.codec import encode_tree
from checkpointd.format.dtypes import decode_dtype, encode_dtype
from checkpointd.format.header import TensorEntry
from checkpointd.format.layout import (
    MANIFEST_NAME,
    check_component_name,
    step_dirname,
    tensor_file_name,
    tree_file_name,
)
from checkpointd.read.catalog import read_manifest
from checkpointd.write.capture import CapturedComponent, StagingBuffer
from checkpointd.write.loop import WriteService
from checkpointd.write.plan import Snapshot, WriteFile, plan_snapshot

from . import protocol as p
from .memtier import HeldCheckpoint
from .protocol import ComponentDesc, EntryDesc, ProtocolError, SnapshotDesc
from .shm import MappedSegment

__all__ = ["describe", "held_checkpoint", "rebuild"]


def describe(snapshot: Snapshot) -> SnapshotDesc:
    """The description of a captured ``snapshot`` (caller thread, inside ``save()``).

    UnsupportedValueError for what the service cannot write yet (DTensor shards,
    incremental references)."""
    components: list[ComponentDesc] = []
    for component in snapshot.components:
        if component.shards or component.blobs:
            raise UnsupportedValueError(
                f"component {component.name!r} holds DTensor shards or incremental references: "
                "the checkpoint service does not write those yet (use service=None)"
            )
        entries = [
            EntryDesc(e.name, encode_dtype(e.dtype, "code"), list(e.shape), e.begin, e.end)
            for e in component.entries
        ]
        tree = encode_tree(component.tree)
        components.append(
            ComponentDesc(component.name, tree, entries, component.offset, component.nbytes)
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


def rebuild(desc: SnapshotDesc, arena: torch.Tensor) -> Snapshot:
    """The Snapshot ``desc`` describes, over ``arena`` (the segment, as uint8).

    ProtocolError where the description does not fit the segment or names a
    dtype, a component or a shape no capture could have made."""
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
        if not 0 <= comp.offset <= comp.offset + comp.nbytes <= size or comp.nbytes < 0:
            raise ProtocolError(
                f"component {comp.name!r} spans bytes {comp.offset}..{comp.offset + comp.nbytes}"
                f" of a {size}-byte segment"
            )
        entries = [_entry(e, comp) for e in comp.entries]
        components.append(
            CapturedComponent(comp.name, msgspec.Raw(comp.tree), entries, comp.offset, comp.nbytes)
        )
    try:
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
        )
    except InvalidArgumentError as exc:
        raise ProtocolError(str(exc)) from None


def _entry(entry: EntryDesc, comp: ComponentDesc) -> TensorEntry:
    dtype = decode_dtype(entry.dtype)
    if dtype is None:
        raise ProtocolError(f"tensor {entry.name!r} has unknown dtype {entry.dtype!r}")
    if any(d < 0 for d in entry.shape):
        raise ProtocolError(f"tensor {entry.name!r} has a negative dimension")
    expected = math.prod(entry.shape) * dtype.itemsize
    if not 0 <= entry.begin <= entry.end <= comp.nbytes or entry.end - entry.begin != expected:
        raise ProtocolError(
            f"tensor {entry.name!r} of component {comp.name!r} does not fit its data region"
        )
    return TensorEntry(entry.name, dtype, tuple(entry.shape), entry.begin, entry.end)


def held_checkpoint(
    service: WriteService, snapshot: Snapshot, segment: MappedSegment
) -> HeldCheckpoint | None:
    """What the memory tier keeps of a just-committed save: the manifest it published
    (read back) and, per listed file, its head and its range of the segment; None if
    the manifest lists anything this snapshot does not hold. Worker thread."""
    store, step = service.store, snapshot.step
    manifest_bytes = store.read_bytes(f"{step_dirname(step)}/{MANIFEST_NAME}")
    manifest = read_manifest(store, step)
    token = "m"
    planned = {f.name: f for f in plan_snapshot(snapshot, token).files if isinstance(f, WriteFile)}
    offsets = {c.name: c.offset for c in snapshot.components}
    files: list[p.HeldFile] = []
    for name, entry in manifest.components.items():
        tree = planned.get(tree_file_name(name, token))
        if tree is None or entry.sharded or entry.refs:
            return None
        files.append(p.HeldFile(entry.tree, bytes(tree.parts[0])))
        if entry.tensors:
            tensors = planned.get(tensor_file_name(name, token))
            if tensors is None or len(entry.tensors) != 1:
                return None
            head = bytes(tensors.parts[0])
            length = memoryview(tensors.parts[1]).nbytes
            files.append(p.HeldFile(entry.tensors[0], head, offsets[name], length))
    sizes = {f.path: f.size for f in manifest.files}
    held = {f.path: len(f.head) + f.length for f in files}
    if sizes != held or manifest.blobs:
        return None
    return HeldCheckpoint(step, segment, manifest_bytes, files)
