"""Capture: turn the caller's live state into an immutable snapshot in staging memory.

Runs on the caller's thread, inside ``save()``. It walks each component's
state tree (storable.py validates every value and builds the stored tree), and
copies every tensor into one staging arena that is reused from save to save
(pinned for CUDA sources, copies issued non-blocking and synchronized once).
Nothing the caller owns is referenced by the snapshot afterwards, so the caller
may change its tensors as soon as ``capture`` returns. With overlapped staging a ``copier`` (staging.py) performs
the copies instead, some of them after ``capture`` returns.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from checkpointd import tunables
from checkpointd.errors import UnsupportedValueError
from checkpointd.format.header import TensorEntry
from checkpointd.format.layout import REGION_ALIGN as _REGION_ALIGN
from checkpointd.format.layout import check_component_name
from checkpointd.memory import bytecopy
from checkpointd.state.stateful import component_state
from checkpointd.state.storable import CapturedShard, Source, Walker

__all__ = [
    "Allocate",
    "BufferPool",
    "CapturedComponent",
    "CapturedShard",
    "Copier",
    "Copy",
    "StagingBuffer",
    "capture",
    "copy_now",
]


Allocate = Callable[[int, bool], torch.Tensor]
"""``(nbytes, pinned)`` -> a uint8 tensor of at least ``nbytes`` over memory someone else
owns (the checkpoint service's shared memory); see ``StagingBuffer``."""


class StagingBuffer:
    """A host byte arena reused across saves; pinned when it holds CUDA sources.

    Owned by one save at a time: capture fills it on the caller thread, the
    writer reads it in the background, then it goes back to the pool. With an
    ``allocate`` function, each ``reserve`` takes its arena from it (a fresh
    shared-memory segment per save); ``over(arena)`` wraps memory already filled.
    """

    def __init__(self, allocate: Allocate | None = None) -> None:
        self._arena: torch.Tensor | None = None
        self._allocate = allocate
        self.allocations = 0
        self._targets: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}

    @classmethod
    def over(cls, arena: torch.Tensor) -> StagingBuffer:
        """A buffer whose arena is ``arena`` (a uint8 tensor), for reading a snapshot
        captured elsewhere; ``reserve`` refuses to replace it."""
        buffer = cls(_refuse_reserve)
        buffer._arena = arena
        return buffer

    def reserve(self, nbytes: int, *, pinned: bool) -> torch.Tensor:
        """Return a uint8 tensor of at least ``nbytes``, reusing the arena when it fits."""
        if self._allocate is not None:
            self._arena = None
            self._targets = {}  # views of the old arena hold its memory too
            self._arena = self._allocate(nbytes, pinned)
            self.allocations += 1
            return self._arena
        arena = self._arena
        if arena is None or arena.numel() < nbytes or arena.is_pinned() != pinned:
            self._arena = None  # drop the old arena before allocating the new one
            self._targets = {}
            raw = torch.empty(max(nbytes, 1) + _REGION_ALIGN, dtype=torch.uint8, pin_memory=pinned)
            skip = -raw.data_ptr() % _REGION_ALIGN
            arena = raw[skip : skip + max(nbytes, 1)]
            self._arena = arena
            self.allocations += 1
        return arena

    def drop(self) -> None:
        """Forget the arena (its memory is freed once nothing else references it)."""
        self._arena = None
        self._targets = {}

    def targets(
        self, arena: torch.Tensor, places: list[tuple[int, int, torch.dtype, tuple[int, ...]]]
    ) -> list[torch.Tensor]:
        """For each ``(begin, nbytes, dtype, shape)``, the arena's bytes from ``begin`` as a
        tensor of that dtype and shape: ``arena`` (this buffer's, from ``reserve``) viewed
        so. The views are kept for the next capture of the same layout into the same arena
        (three tensor ops each, some microseconds a tensor), only the last capture's; a new
        arena drops them. Caller's thread."""
        assert arena is self._arena
        kept = self._targets
        fresh: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        found: list[torch.Tensor] = []
        for begin, nbytes, dtype, shape in places:
            key = (begin, dtype, shape)
            view = kept.get(key)
            if view is None:
                view = arena[begin : begin + nbytes].view(dtype).view(shape)
            fresh[key] = view
            found.append(view)
        self._targets = fresh
        return found

    def view(self, offset: int, nbytes: int) -> memoryview:
        """Bytes ``offset .. offset + nbytes`` of the arena, without copying."""
        assert self._arena is not None
        return self._arena.numpy().data.cast("B")[offset : offset + nbytes]

    @property
    def capacity(self) -> int:
        """Bytes currently allocated."""
        return 0 if self._arena is None else self._arena.numel()

    @property
    def pinned(self) -> bool:
        """True if the arena is in pinned (page-locked) host memory."""
        return self._arena is not None and self._arena.is_pinned()


class BufferPool:
    """Idle staging buffers that writers share (the Lightning plugin's writers, one per
    root): a writer made with ``buffer_pool=`` takes its ``max_pending`` buffers from
    it and gives them back once its service has stopped, so the next writer reuses
    their warm pages instead of touching fresh ones on the training thread.
    Thread-safe (a dropped writer gives back from its finalizer)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[StagingBuffer] = []

    def take(self) -> StagingBuffer:
        """An idle buffer (the most recently given back), or a new empty one."""
        with self._lock:
            return self._idle.pop() if self._idle else StagingBuffer()

    def give_back(self, buffers: Iterable[StagingBuffer]) -> None:
        """Return buffers no save uses any more."""
        with self._lock:
            self._idle.extend(buffers)

    def __len__(self) -> int:
        """How many buffers are idle."""
        with self._lock:
            return len(self._idle)


def _refuse_reserve(nbytes: int, pinned: bool) -> torch.Tensor:
    raise AssertionError("a StagingBuffer.over(arena) is read, never captured into")


@dataclass(slots=True)
class CapturedComponent:
    """One component of a snapshot.

    ``tree`` is made of fresh containers, primitives and format nodes (no
    reference to the caller's objects); ``entries`` place each tensor in the
    component's data region, which starts at ``offset`` in the staging arena.
    ``shards`` are its DTensors; the local shards this rank writes are laid out
    by ``shard_entries`` in a second region at ``shard_offset``.
    """

    name: str
    tree: Any
    entries: list[TensorEntry] = field(default_factory=list)
    offset: int = 0
    nbytes: int = 0
    shards: list[CapturedShard] = field(default_factory=list)
    shard_entries: list[TensorEntry] = field(default_factory=list)
    shard_offset: int = 0
    shard_nbytes: int = 0
    blobs: dict[str, str] = field(default_factory=dict)
    """Tensors an incremental writer found unchanged at capture -> their stored blob: their
    place in the arena is left unfilled (see incremental.py)."""
    crcs: list[int | None] = field(default_factory=list)
    """The CRC32C of each of ``entries``' bytes in the arena, taken as they were copied
    there (None where it was not); empty if none was (overlapped staging). The writer
    uses them instead of reading those bytes again to checksum its files."""


def _aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole number of regions."""
    return math.ceil(nbytes / _REGION_ALIGN) * _REGION_ALIGN


def _layout(sources: list[Source]) -> tuple[list[Source], list[TensorEntry], int]:
    """Order tensors by decreasing element size so every tensor is naturally aligned."""
    ordered = sorted(sources, key=lambda s: -s.tensor.element_size())
    entries: list[TensorEntry] = []
    position = 0
    for source in ordered:
        shape = tuple(source.tensor.shape)
        entries.append(
            TensorEntry(source.name, source.tensor.dtype, shape, position, position + source.nbytes)
        )
        position += source.nbytes
    return ordered, entries, position


Copy = tuple[torch.Tensor, torch.Tensor]
"""One tensor to stage: (source, its target view in the arena)."""

Copier = Callable[[list[Copy], bool], None]
"""Performs a save's copies into the arena: ``(copies, uses_cuda)``; see staging.py."""

Prehash = Callable[[str, str, torch.Tensor], str | None]
"""``(component, tensor name, tensor)`` -> the blob already holding those bytes, or None
to copy the tensor (an incremental writer's ``IncrementalSaver.prehash``)."""


def capture(
    state: Mapping[str, Any],
    buffer: StagingBuffer,
    copier: Copier | None = None,
    *,
    ranked: bool = False,
    prehash: Prehash | None = None,
) -> list[CapturedComponent]:
    """Snapshot ``state`` into ``buffer``; returns once every byte is in host memory,
    or, with a ``copier`` (overlapped staging), once it has issued the copies.

    Called on the caller's thread. Raises UnsupportedValueError (before copying
    anything) if a value cannot be stored. ``ranked``: every rank of the job saves
    this state together (DTensors spread over ranks are allowed).
    """
    if not isinstance(state, Mapping):
        raise UnsupportedValueError(
            f"state must be a mapping of component name to value, not {type(state).__qualname__}"
        )
    with torch.no_grad():  # no autograd bookkeeping: detach/to_local are plain then
        return _capture(state, buffer, copier, ranked, prehash)


def _capture(
    state: Mapping[str, Any],
    buffer: StagingBuffer,
    copier: Copier | None,
    ranked: bool,
    prehash: Prehash | None,
) -> list[CapturedComponent]:
    planned: list[tuple[CapturedComponent, list[Source]]] = []
    planned_shards: list[list[Source]] = []
    total = 0
    for name, value in state.items():
        check_component_name(name)
        walker = Walker(name, ranked)
        tree = walker.walk(component_state(value, name), ())
        ordered, entries, nbytes = _layout(walker.sources)
        component = CapturedComponent(name, tree, entries, total, nbytes, walker.shards)
        if prehash is not None:
            for source in ordered:
                if (blob := prehash(name, source.name, source.tensor)) is not None:
                    component.blobs[source.name] = blob
        total += _aligned(nbytes)
        shard_sources, component.shard_entries, component.shard_nbytes = _layout(
            walker.shard_sources
        )
        component.shard_offset = total
        total += _aligned(component.shard_nbytes)
        planned.append((component, ordered))
        planned_shards.append(shard_sources)

    regions = [
        (sources, component.entries, component.offset, component.blobs)
        for component, sources in planned
    ] + [
        (sources, component.shard_entries, component.shard_offset, {})
        for (component, _), sources in zip(planned, planned_shards, strict=True)
    ]
    uses_cuda = any(s.tensor.device.type == "cuda" for r in regions for s in r[0])
    arena = buffer.reserve(total, pinned=uses_cuda)
    copied: list[Source] = []
    places: list[tuple[int, int, torch.dtype, tuple[int, ...]]] = []
    owners: list[tuple[list[int | None], int]] = []  # where each copy's CRC32C goes
    for index, (sources, entries, offset, stored) in enumerate(regions):
        crcs: list[int | None] = [None] * len(entries)
        if index < len(planned):  # a data region (shard regions are checked per block)
            planned[index][0].crcs = crcs
        for at, (source, entry) in enumerate(zip(sources, entries, strict=True)):
            if source.nbytes == 0 or source.name in stored:
                crcs[at] = 0 if source.nbytes == 0 else None
                continue
            copied.append(source)
            owners.append((crcs, at))
            places.append((offset + entry.begin, source.nbytes, entry.dtype, entry.shape))
    targets = buffer.targets(arena, places)
    copies = [(s.tensor, t) for s, t in zip(copied, targets, strict=True)]
    if copier is None:
        for (crcs, at), digest in zip(owners, copy_now(copies, uses_cuda), strict=True):
            crcs[at] = digest
    else:  # overlapped: copied later; the writer checksums as it writes
        copier(copies, uses_cuda)
        for component, _ in planned:
            component.crcs = []
    return [component for component, _ in planned]


def copy_now(copies: list[Copy], uses_cuda: bool) -> list[int | None]:
    """Copy every source into its target; returns once the bytes are in host memory,
    with each copy's CRC32C as it landed where it was taken, else None.

    Plain CPU tensors are copied as bytes by the free cores (bytecopy.py: torch's
    per-tensor OpenMP barriers stall when cores are busy); those of at least
    ``tunables.CAPTURE_CRC_MIN_BYTES`` are checksummed piece by piece right after they
    land, while in cache (checksummed later, the bytes are read from memory again).
    CUDA copies are issued non-blocking (the arena is pinned) and synchronized once per
    device. Caller's thread.
    """
    plain: list[Copy] = []
    checked: list[Copy] = []
    where: list[int] = []
    for index, (source, target) in enumerate(copies):
        if not bytecopy.plain(source, target):
            target.copy_(source, non_blocking=uses_cuda)
        elif source.nbytes < tunables.CAPTURE_CRC_MIN_BYTES:
            plain.append((source, target))
        else:
            checked.append((source, target))
            where.append(index)
    bytecopy.copy_plain(plain)
    digests: list[int | None] = [None] * len(copies)
    for index, digest in zip(where, bytecopy.copy_plain_checked(checked), strict=True):
        digests[index] = digest
    if uses_cuda:
        for device in {source.device for source, _ in copies}:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    return digests
