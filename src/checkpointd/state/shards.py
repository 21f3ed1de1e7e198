"""Sharded tensors (DTensor): what a rank's shard is, whether it writes it, and boxes.

A DTensor (FSDP2, tensor parallel, HSDP) is stored as the shards its ranks hold,
each with its offsets in the global tensor. Replicas of a shard (ranks that differ
only along ``Replicate`` mesh dimensions) hold the same bytes: one of them writes
it, chosen by the tensor's ordinal so the replicas share the work. Everything
here is pure arithmetic on shapes and meshes; torch.distributed is imported only
when a DTensor is met.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from checkpointd.errors import RestoreMismatchError, UnsupportedValueError

__all__ = [
    "Box",
    "LocalShard",
    "as_template",
    "holders",
    "intersect",
    "is_dtensor",
    "local_box",
    "local_shard",
    "run_in",
]

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(offsets, shape) of a box in a tensor's index space."""


@dataclass(frozen=True, slots=True)
class LocalShard:
    """This rank's shard of a DTensor: its data, where it sits in the global tensor,
    and whether this rank is the replica that writes it."""

    local: torch.Tensor
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    written: bool


def is_dtensor(value: Any) -> bool:
    """True for a torch.distributed DTensor (without importing torch.distributed)."""
    return type(value).__name__ == "DTensor" and isinstance(value, torch.Tensor)


def local_shard(tensor: Any, ordinal: int, ranked: bool, where: Callable[[], str]) -> LocalShard:
    """This rank's shard of DTensor ``tensor``, the ``ordinal``-th DTensor of its
    component. ``ranked``: the writer saves with every rank of the job; a DTensor
    spread over several ranks cannot be saved by a writer that saves alone. ``where``
    says where the tensor is, for an error. Caller thread. Raises
    UnsupportedValueError for placements it cannot store."""
    mesh, placements = tensor.device_mesh, tuple(tensor.placements)
    shape = tuple(tensor.shape)
    # the checks and the arithmetic depend on the layout alone: once per layout, not per save
    found = _shard_layout(shape, mesh, placements, tuple(map(type, placements)))
    if isinstance(found, str):
        raise UnsupportedValueError(f"{where()}: {found}")
    local_shape, offsets, replica, replicas, spread = found
    if spread > 1 and not ranked:
        raise UnsupportedValueError(
            f"{where()}: a DTensor spread over {spread} ranks needs a writer that saves "
            "with every rank (process_group=None after init_process_group), not one "
            "that saves alone"
        )
    local = tensor.to_local()
    if local.requires_grad:
        local = local.detach()
    written = replica is not None and replica == ordinal % replicas
    if tuple(local.shape) != local_shape:
        raise UnsupportedValueError(
            f"{where()}: the DTensor's local shard has shape {tuple(local.shape)}, its placements "
            f"give {local_shape}; uneven or strided shards are not supported"
        )
    return LocalShard(local, shape, offsets, written)


_Layout = tuple[tuple[int, ...], tuple[int, ...], int | None, int, int]


@functools.lru_cache(maxsize=4096)
def _shard_layout(
    shape: tuple[int, ...], mesh: Any, placements: tuple[Any, ...], kinds: tuple[type, ...]
) -> _Layout | str:
    """``_placement`` and the mesh's size for a DTensor of ``shape`` placed so, or why it
    cannot be stored. Cached: a save meets the same few layouts for every parameter, and
    again at every save. ``kinds`` (the placements' types) keeps a subclass of a placement
    that compares equal to it apart."""
    for placement in placements:
        if placement.is_partial():
            return (
                "a DTensor with a Partial placement holds unreduced values; "
                "redistribute it to Shard or Replicate before saving"
            )
        if not (placement.is_shard() or placement.is_replicate()) or (
            type(placement).__name__ != "Shard" and placement.is_shard()
        ):
            return f"DTensor placement {placement!r} is not supported (Shard and Replicate are)"
    return (*_placement(shape, mesh, placements), mesh.size())


@functools.lru_cache(maxsize=4096)
def _placement(
    shape: tuple[int, ...], mesh: Any, placements: tuple[Any, ...]
) -> tuple[tuple[int, ...], tuple[int, ...], int | None, int]:
    """This rank's (local shape, offsets, replica index or None if outside the mesh,
    replica count) for a DTensor of ``shape`` placed so; cached, as the same few
    placements repeat for every parameter and every save."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    coordinate = mesh.get_coordinate()
    replica = None if coordinate is None else _replica(mesh, placements, coordinate)
    return tuple(local_shape), tuple(offsets), replica, _replicas(mesh, placements)


def _replicas(mesh: Any, placements: Sequence[Any]) -> int:
    """How many ranks hold each shard (the product of the Replicate dimensions' sizes)."""
    return math.prod(mesh.size(d) for d, p in enumerate(placements) if p.is_replicate())


def _replica(mesh: Any, placements: Sequence[Any], coordinate: Sequence[int]) -> int:
    """Which replica of its shard this rank holds: its index along the Replicate dims."""
    index = 0
    for dim, placement in enumerate(placements):
        if placement.is_replicate():
            index = index * mesh.size(dim) + coordinate[dim]
    return index


def holders(template: Any) -> tuple[int, ...]:
    """The ranks of live DTensor ``template``'s mesh that hold the same box as this rank
    (its replicas along the Replicate dimensions, itself first): where a checkpoint saved
    on this layout keeps the shard index that describes this rank's box. () outside
    the mesh."""
    return _holders(template.device_mesh, tuple(template.placements))


@functools.lru_cache(maxsize=256)
def _holders(mesh: Any, placements: tuple[Any, ...]) -> tuple[int, ...]:
    """``holders``, cached: ``mesh.mesh`` builds a new rank tensor on every access
    (tens of microseconds, per tensor restored)."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return ()
    ranks_tensor = mesh.mesh
    where = tuple(
        slice(None) if p.is_replicate() else coordinate[d] for d, p in enumerate(placements)
    )
    ranks = [int(r) for r in ranks_tensor[where].flatten().tolist()]
    me = int(ranks_tensor[tuple(coordinate)])
    return (me, *(r for r in ranks if r != me))


def intersect(a: Box, b: Box) -> Box | None:
    """The box both ``a`` and ``b`` cover, or None if they do not overlap."""
    offsets, shape = [], []
    for ao, an, bo, bn in zip(a[0], a[1], b[0], b[1], strict=True):
        begin, end = max(ao, bo), min(ao + an, bo + bn)
        if end <= begin:
            return None
        offsets.append(begin)
        shape.append(end - begin)
    return tuple(offsets), tuple(shape)


def run_in(outer: Box, inner: Box) -> tuple[int, int] | None:
    """(first, last + 1) elements of box ``inner`` in the row-major order of box
    ``outer`` (which holds it) if they are one run, else None."""
    strides = [1] * len(outer[1])
    for d in range(len(strides) - 2, -1, -1):
        strides[d] = strides[d + 1] * outer[1][d + 1]
    first = sum((i - o) * s for i, o, s in zip(inner[0], outer[0], strides, strict=True))
    last = first + sum((n - 1) * s for n, s in zip(inner[1], strides, strict=True))
    return (first, last + 1) if last + 1 - first == math.prod(inner[1]) else None


def local_box(template: Any) -> Box:
    """The box of the global tensor that live DTensor ``template``'s local shard holds."""
    placements = tuple(template.placements)
    local_shape, offsets, _, _ = _placement(tuple(template.shape), template.device_mesh, placements)
    return offsets, local_shape


def as_template(
    name: str,
    template: Any,
    plain: torch.Tensor | None,
    sharded: Any,
    region: Callable[[str, Any, Box], torch.Tensor],
) -> Any:
    """The stored tensor ``name`` as a DTensor placed like the live DTensor ``template``:
    only this rank's part, read by ``region`` from a sharded tensor, or sliced out of a
    whole ``plain`` one. Raises RestoreMismatchError if the global shapes differ."""
    from torch.distributed.tensor import DTensor

    stored = tuple(sharded.shape) if sharded is not None else tuple(plain.shape)  # type: ignore[union-attr]
    if stored != tuple(template.shape):
        raise RestoreMismatchError(
            f"tensor {name!r}: stored shape {list(stored)}, the target's {list(template.shape)}"
        )
    mesh, placements = template.device_mesh, tuple(template.placements)
    box = local_box(template)
    if sharded is not None:
        local = region(name, sharded, box)
    else:
        assert plain is not None
        local = plain[tuple(slice(o, o + n) for o, n in zip(*box, strict=True))].clone()
    return DTensor.from_local(
        local.to(template.device),
        mesh,
        placements,
        run_check=False,
        shape=template.shape,
        stride=template.stride(),
    )
