"""Capture: turn the caller's live state into an immutable snapshot in staging memory.

Runs on the caller's thread, inside ``save()``. It walks each component's
state tree, validates every value, and copies every tensor into one staging
arena that is reused from save to save (pinned for CUDA sources, copies issued
non-blocking and synchronized once). Nothing the caller owns is referenced by
the snapshot afterwards, so the caller may change its tensors as soon as
``capture`` returns. With overlapped staging a ``copier`` (staging.py) performs
the copies instead, some of them after ``capture`` returns.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from checkpointd import tree as trees
from checkpointd.errors import UnsupportedValueError
from checkpointd.format import (
    BigInt,
    DTypeNode,
    NumpyScalarNode,
    StateDictNode,
    TensorRef,
    TupleNode,
    numpy_scalar_node,
)
from checkpointd.header import TensorEntry, check_storable, shape_fits
from checkpointd.layout import REGION_ALIGN as _REGION_ALIGN
from checkpointd.layout import check_component_name
from checkpointd.shards import is_dtensor, local_shard
from checkpointd.stateful import component_state
from checkpointd.tunables import MAX_TREE_DEPTH

__all__ = [
    "CapturedComponent",
    "CapturedShard",
    "Copier",
    "Copy",
    "StagingBuffer",
    "capture",
    "copy_now",
]

_MSGPACK_INT_MIN = -(2**63)
_MSGPACK_INT_MAX = 2**64 - 1
# Wider ints are stored as decimal text; Python refuses to print more than 4300 digits.
_BIGINT_MAX_BITS = 4096


class StagingBuffer:
    """A host byte arena reused across saves; pinned when it holds CUDA sources.

    Owned by one save at a time: capture fills it on the caller thread, the
    writer reads it in the background, then it goes back to the pool.
    """

    def __init__(self) -> None:
        self._arena: torch.Tensor | None = None
        self.allocations = 0

    def reserve(self, nbytes: int, *, pinned: bool) -> torch.Tensor:
        """Return a uint8 tensor of at least ``nbytes``, reusing the arena when it fits."""
        arena = self._arena
        if arena is None or arena.numel() < nbytes or arena.is_pinned() != pinned:
            self._arena = None  # drop the old arena before allocating the new one
            raw = torch.empty(max(nbytes, 1) + _REGION_ALIGN, dtype=torch.uint8, pin_memory=pinned)
            skip = -raw.data_ptr() % _REGION_ALIGN
            arena = raw[skip : skip + max(nbytes, 1)]
            self._arena = arena
            self.allocations += 1
        return arena

    def view(self, offset: int, nbytes: int) -> memoryview:
        """Bytes ``offset .. offset + nbytes`` of the arena, without copying."""
        assert self._arena is not None
        return self._arena.numpy().data.cast("B")[offset : offset + nbytes]

    @property
    def capacity(self) -> int:
        """Bytes currently allocated."""
        return 0 if self._arena is None else self._arena.numel()


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


@dataclass(frozen=True, slots=True)
class CapturedShard:
    """A DTensor of a component: its name in the tree, global shape and dtype, and this
    rank's shard (``offsets``/``local_shape``), in ``shard_entries`` if ``written``."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    local_shape: tuple[int, ...]
    written: bool


@dataclass(slots=True)
class _Source:
    name: str
    tensor: torch.Tensor
    nbytes: int


class _Walker:
    """Builds the storable tree of one component and collects its tensors once each."""

    def __init__(self, component: str, ranked: bool = False) -> None:
        self.component = component
        self.ranked = ranked
        self.sources: list[_Source] = []
        self.shards: list[CapturedShard] = []
        self.shard_sources: list[_Source] = []
        self._names: set[str] = set()
        self._aliases: dict[tuple[Any, ...], str] = {}
        self._active: set[int] = set()

    def walk(self, value: Any, path: tuple[str, ...], level: int = 0) -> Any:
        """The storable form of ``value``, which sits inside ``level`` containers.

        Exact types first: NumPy's float64, str_ and bytes_ subclass float, str
        and bytes, and must stay NumPy scalars. Other subclasses of int, float,
        str and bytes (IntEnum, a str subclass) are stored as the plain value and
        load as int, float, str or bytes.
        """
        kind = type(value)
        if value is None or kind is bool or kind is float or kind is bytes:
            return value
        if kind is str:
            return self._text(value, path, "string")
        if kind is int:
            return self._int(value, path)
        if isinstance(value, torch.Tensor):
            return TensorRef(self._add_tensor(value, path))
        if isinstance(value, np.ndarray):
            return TensorRef(self._add_tensor(self._array(value, path), path), True)
        if isinstance(value, np.generic):
            return self._numpy_scalar(value, path)
        if isinstance(value, int):
            return self._int(int.__int__(value), path)
        if isinstance(value, float):
            return float.__float__(value)
        if isinstance(value, str):
            return self._text(str.__str__(value), path, "string")
        if isinstance(value, bytes):
            return bytes.__bytes__(value)
        if isinstance(value, torch.dtype):
            return DTypeNode(str(value).removeprefix("torch."))
        if isinstance(value, (Mapping, list, tuple)):
            return self._container(value, path, level + 1)
        raise UnsupportedValueError(
            f"{self._where(path)}: values of type {type(value).__qualname__} cannot be stored; "
            "use tensors, arrays, JSON-like primitives, or an object with state_dict()"
        )

    def _container(
        self,
        value: Mapping[Any, Any] | list[Any] | tuple[Any, ...],
        path: tuple[str, ...],
        level: int,
    ) -> Any:
        if level > MAX_TREE_DEPTH:
            prefix = self._where(path[:8]) + ("/..." if len(path) > 8 else "")
            raise UnsupportedValueError(
                f"{prefix}: the state is nested deeper than "
                f"{MAX_TREE_DEPTH} containers (dicts, lists, tuples), the most a checkpoint "
                "holds; flatten it or keep deep data in a tensor"
            )
        if id(value) in self._active:
            raise UnsupportedValueError(f"{self._where(path)}: the state contains a cycle")
        self._active.add(id(value))
        try:
            if isinstance(value, Mapping):
                items = {
                    self._key(k, path): self.walk(v, (*path, str(k)), level)
                    for k, v in value.items()
                }
                metadata = trees.metadata(value)
                if metadata is not None:
                    # _metadata sits one level below the state dict, as it does when loaded.
                    meta = self.walk(dict(metadata), (*path, "_metadata"), level)
                    return StateDictNode(items, meta)
                return items
            items_list = [self.walk(v, (*path, str(i)), level) for i, v in enumerate(value)]
            return TupleNode(items_list) if isinstance(value, tuple) else items_list
        finally:
            self._active.discard(id(value))

    def _key(self, key: Any, path: tuple[str, ...]) -> Any:
        """A dict key as stored: a plain str or a 64-bit int (subclasses become those)."""
        if isinstance(key, str):
            return self._text(str.__str__(key), path, "dict key")
        if isinstance(key, int) and _MSGPACK_INT_MIN <= key <= _MSGPACK_INT_MAX:
            return int.__int__(key)
        raise UnsupportedValueError(
            f"{self._where(path)}: dict key {key!r} of type {type(key).__qualname__} cannot be "
            "stored; keys must be str or int"
        )

    def _text(self, text: str, path: tuple[str, ...], what: str) -> str:
        """``text`` if it is valid Unicode; a lone surrogate (what os.fsdecode makes of a
        non-UTF-8 file name) has no UTF-8 form, so it is refused here, not in the background.
        """
        if not text.isascii():
            try:
                text.encode()
            except UnicodeEncodeError:
                shown = repr(text[:80]) + ("..." if len(text) > 80 else "")
                raise UnsupportedValueError(
                    f"{self._where(path)}: {what} {shown} has a lone surrogate, which cannot be "
                    "stored; keep file names as bytes (os.fsencode) or decode with "
                    "errors='replace'"
                ) from None
        return text

    def _int(self, value: int, path: tuple[str, ...]) -> int | BigInt:
        if _MSGPACK_INT_MIN <= value <= _MSGPACK_INT_MAX:
            return value
        if value.bit_length() > _BIGINT_MAX_BITS:
            raise UnsupportedValueError(
                f"{self._where(path)}: integers wider than {_BIGINT_MAX_BITS} bits cannot be stored"
            )
        return BigInt(value)

    def _array(self, value: np.ndarray, path: tuple[str, ...]) -> torch.Tensor:
        if isinstance(value, np.ma.MaskedArray):
            raise UnsupportedValueError(
                f"{self._where(path)}: masked arrays cannot be stored (the mask would be lost); "
                "store .data and .mask"
            )
        return _numpy_to_tensor(value, self._where(path))

    def _numpy_scalar(self, value: np.generic, path: tuple[str, ...]) -> NumpyScalarNode:
        node = numpy_scalar_node(value)
        if node is None:
            raise UnsupportedValueError(
                f"{self._where(path)}: NumPy scalar of dtype {value.dtype} cannot be stored"
            )
        return node

    def _add_tensor(self, tensor: torch.Tensor, path: tuple[str, ...]) -> str:
        where = self._where(path)
        if is_dtensor(tensor):
            return self._add_dtensor(tensor, path)
        plain = tensor.detach()
        if type(plain) is not torch.Tensor:
            raise UnsupportedValueError(
                f"{where}: tensor subclass {type(tensor).__qualname__} is not supported; "
                "convert it to a plain tensor (e.g. DTensor.full_tensor())"
            )
        if plain.layout != torch.strided or plain.is_quantized or plain.is_nested:
            raise UnsupportedValueError(f"{where}: only dense (strided) tensors can be stored")
        if plain.device.type == "meta":
            raise UnsupportedValueError(f"{where}: meta tensors hold no data to store")
        check_storable(plain.dtype, where)
        shape = tuple(plain.shape)
        numel = plain.numel()
        if numel == 0 and not shape_fits(shape):  # a non-empty shape fits: numel is an int64
            raise UnsupportedValueError(
                f"{where}: shape {shape} is too large to store (the product of "
                "its dimensions, zeros counted as one, must fit 64 bits)"
            )
        alias_key = trees.alias_key(plain)
        if numel > 0 and alias_key in self._aliases:
            return self._aliases[alias_key]
        name = self._unique_name(path)
        self._aliases[alias_key] = name
        source = plain
        if (plain.is_conj() or plain.is_neg()) and plain.device.type != "cpu":
            # A non-blocking device-to-host copy_ applies these bits on the host before
            # the transfer lands (pytorch/pytorch#146286): resolve them on the device.
            source = plain.resolve_conj().resolve_neg()
        self.sources.append(_Source(name, source, numel * plain.element_size()))
        return name

    def _add_dtensor(self, tensor: Any, path: tuple[str, ...]) -> str:
        """Record a DTensor: its name in the tree, and its local shard as a source of the
        shard region if this rank is the replica that writes it."""
        key = ("dtensor", id(tensor))
        if key in self._aliases:
            return self._aliases[key]
        where = self._where(path)
        shard = local_shard(tensor, len(self.shards), self.ranked, where)
        check_storable(tensor.dtype, where)
        name = self._unique_name(path)
        self._aliases[key] = name
        self.shards.append(
            CapturedShard(
                name,
                tensor.dtype,
                shard.shape,
                shard.offsets,
                tuple(shard.local.shape),
                shard.written,
            )
        )
        if shard.written:
            local = shard.local
            self.shard_sources.append(_Source(name, local, local.numel() * local.element_size()))
        return name

    def _unique_name(self, path: tuple[str, ...]) -> str:
        base = "/".join(path) or "tensor"
        if base == "__metadata__":
            base = "__metadata__~"
        name, n = base, 1
        while name in self._names:
            name, n = f"{base}~{n}", n + 1
        self._names.add(name)
        return name

    def _where(self, path: tuple[str, ...]) -> str:
        return "/".join((self.component, *path))


def _numpy_to_tensor(array: np.ndarray, where: str) -> torch.Tensor:
    if array.dtype.hasobject or array.dtype.kind not in "biufc":
        raise UnsupportedValueError(
            f"{where}: NumPy arrays of dtype {array.dtype} cannot be stored"
        )
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    try:
        return torch.from_numpy(np.ascontiguousarray(array))
    except TypeError as exc:
        raise UnsupportedValueError(f"{where}: {exc}") from exc


def _aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole number of regions."""
    return math.ceil(nbytes / _REGION_ALIGN) * _REGION_ALIGN


def _layout(sources: list[_Source]) -> tuple[list[_Source], list[TensorEntry], int]:
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
    planned: list[tuple[CapturedComponent, list[_Source]]] = []
    planned_shards: list[list[_Source]] = []
    total = 0
    for name, value in state.items():
        check_component_name(name)
        walker = _Walker(name, ranked)
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
    copies: list[Copy] = []
    for sources, entries, offset, stored in regions:
        for source, entry in zip(sources, entries, strict=True):
            if source.nbytes == 0 or source.name in stored:
                continue
            begin = offset + entry.begin
            target = arena[begin : begin + source.nbytes].view(source.tensor.dtype)
            copies.append((source.tensor, target.view(source.tensor.shape)))
    (copier or copy_now)(copies, uses_cuda)
    return [component for component, _ in planned]


def copy_now(copies: list[Copy], uses_cuda: bool) -> None:
    """Copy every source into its target; returns once the bytes are in host memory.

    CUDA copies are issued non-blocking (the arena is pinned) and synchronized once
    per device. Caller's thread, or staging's copier thread for CPU sources.
    """
    for source, target in copies:
        target.copy_(source, non_blocking=uses_cuda)
    if uses_cuda:
        for device in {source.device for source, _ in copies}:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
