"""A snapshot and its description: the trainer describes what it captured into a segment,
the service rebuilds the very ``plan.Snapshot`` an in-process save would write.

The trees travel encoded (``format.encode_tree``) and come back as ``msgspec.Raw``,
which the plan's ``encode_tree`` writes out byte for byte: the files are the same
as an in-process save's. Every offset, size and name is checked against the
segment before the service trusts it. Imports torch.
"""

from __future__ import annotations

import math

import msgspec
import torch

from checkpointd.capture import CapturedComponent, StagingBuffer
from checkpointd.errors import CheckpointError, InvalidArgumentError, UnsupportedValueError
from checkpointd.format import encode_tree
from checkpointd.header import DTYPE_CODES, DTYPES_BY_CODE, TensorEntry
from checkpointd.layout import check_component_name
from checkpointd.plan import Snapshot

from .protocol import ComponentDesc, EntryDesc, ProtocolError, SnapshotDesc

__all__ = ["describe", "rebuild"]


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
            EntryDesc(e.name, DTYPE_CODES[e.dtype], list(e.shape), e.begin, e.end)
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
        )
    except InvalidArgumentError as exc:
        raise ProtocolError(str(exc)) from None


def _entry(entry: EntryDesc, comp: ComponentDesc) -> TensorEntry:
    dtype = DTYPES_BY_CODE.get(entry.dtype)
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
