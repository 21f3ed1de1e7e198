"""What a component's value is stored as: the walk that validates it and builds its tree.

``Walker`` runs on the caller's thread, inside ``save()`` (through capture.py): it
checks every value, turns containers and primitives into fresh storable nodes (no
reference to the caller's objects), and collects each tensor once (aliases share
one name) as a ``Source`` to copy, or, for a DTensor, this rank's shard
(``CapturedShard``). It copies nothing: capture.py lays the sources out in the
staging arena and copies them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from checkpointd import tunables
from checkpointd.errors import UnsupportedValueError
from checkpointd.format.codec import (
    BigInt,
    DTypeNode,
    NumpyScalarNode,
    StateDictNode,
    TensorRef,
    TupleNode,
    numpy_scalar_node,
)
from checkpointd.format.dtypes import CODES, check_storable, encode_dtype
from checkpointd.format.header import shape_fits
from checkpointd.state import tree as trees
from checkpointd.state.shards import is_dtensor, local_shard

__all__ = ["CapturedShard", "Source", "Walker"]

_MSGPACK_INT_MIN = -(2**63)
_MSGPACK_INT_MAX = 2**64 - 1
# Wider ints are stored as decimal text; Python refuses to print more than 4300 digits.


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
class Source:
    name: str
    tensor: torch.Tensor
    nbytes: int


class Walker:
    """Builds the storable tree of one component and collects its tensors once each."""

    def __init__(self, component: str, ranked: bool = False) -> None:
        self.component = component
        self.ranked = ranked
        self.sources: list[Source] = []
        self.shards: list[CapturedShard] = []
        self.shard_sources: list[Source] = []
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
        if kind is dict or kind is list:
            return self._container(value, path, level + 1)
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
            return DTypeNode(encode_dtype(value, "name"))
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
        if level > tunables.MAX_TREE_DEPTH:
            prefix = self._where(path[:8]) + ("/..." if len(path) > 8 else "")
            raise UnsupportedValueError(
                f"{prefix}: the state is nested deeper than "
                f"{tunables.MAX_TREE_DEPTH} containers (dicts, lists, tuples), the most a checkpoint "
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
        if type(key) is str:
            return self._text(key, path, "dict key")
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
        if value.bit_length() > (most := tunables.MAX_BIGINT_BITS):
            raise UnsupportedValueError(
                f"{self._where(path)}: integers wider than {most} bits cannot be stored"
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
        if is_dtensor(tensor):
            return self._add_dtensor(tensor, path)
        # detached (a Parameter becomes a Tensor), unless it is a plain tensor already
        plain = (
            tensor if type(tensor) is torch.Tensor and not tensor.requires_grad else tensor.detach()
        )
        if type(plain) is not torch.Tensor:
            raise UnsupportedValueError(
                f"{self._where(path)}: tensor subclass {type(tensor).__qualname__} is not "
                "supported; convert it to a plain tensor (e.g. DTensor.full_tensor())"
            )
        if plain.layout != torch.strided or plain.is_quantized or plain.is_nested:
            raise UnsupportedValueError(
                f"{self._where(path)}: only dense (strided) tensors can be stored"
            )
        if plain.device.type == "meta":
            raise UnsupportedValueError(f"{self._where(path)}: meta tensors hold no data to store")
        if plain.dtype not in CODES:
            check_storable(plain.dtype, self._where(path))
        shape = tuple(plain.shape)
        numel = plain.numel()
        if numel == 0 and not shape_fits(shape):  # a non-empty shape fits: numel is an int64
            raise UnsupportedValueError(
                f"{self._where(path)}: shape {shape} is too large to store (the product of "
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
        self.sources.append(Source(name, source, numel * plain.element_size()))
        return name

    def _add_dtensor(self, tensor: Any, path: tuple[str, ...]) -> str:
        """Record a DTensor: its name in the tree, and its local shard as a source of the
        shard region if this rank is the replica that writes it."""
        key = ("dtensor", id(tensor))
        if key in self._aliases:
            return self._aliases[key]
        shard = local_shard(tensor, len(self.shards), self.ranked, lambda: self._where(path))
        if tensor.dtype not in CODES:
            check_storable(tensor.dtype, self._where(path))
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
            self.shard_sources.append(Source(name, local, local.numel() * local.element_size()))
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
