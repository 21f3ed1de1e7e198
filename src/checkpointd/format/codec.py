"""The msgpack state tree of one component: the structure around its tensors.

A component is stored as a tree file (``{name}.tree.msgpack``) holding the
structure around the tensors, and, when it has tensors, a tensor file
(``{name}.safetensors``) in the safetensors layout. The tree refers to tensors
by their name in the tensor file. Nothing here uses pickle; decoding only
builds containers, primitives and tensors. docs/format.md is the spec.
"""

from __future__ import annotations

import functools
import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import msgspec
import numpy as np
import torch

from checkpointd import tunables
from checkpointd.errors import CorruptCheckpointError, UnsupportedValueError
from checkpointd.format.dtypes import decode_dtype

__all__ = [
    "BigInt",
    "DTypeNode",
    "NumpyScalarNode",
    "StateDictNode",
    "TensorRef",
    "TupleNode",
    "decode_tree",
    "encode_tree",
    "numpy_scalar_node",
]


# ---------------------------------------------------------------------------
# Tree nodes: what capture puts in place of values msgpack cannot carry as-is.
# Plain slotted classes, not dataclasses: msgspec would encode dataclasses itself
# instead of handing them to the extension hook.


class TensorRef:
    """A tensor stored in the component's tensor file under ``name`` (an array if ``numpy``)."""

    __slots__ = ("name", "numpy")

    def __init__(self, name: str, numpy: bool = False) -> None:
        self.name = name
        self.numpy = numpy


class TupleNode:
    """A tuple (msgpack has only arrays; restoring a tuple as a list would change types)."""

    __slots__ = ("items",)

    def __init__(self, items: list[Any]) -> None:
        self.items = items


class BigInt:
    """An int outside msgpack's 64-bit range (NumPy's PCG64 state has 128-bit ints)."""

    __slots__ = ("value",)

    def __init__(self, value: int) -> None:
        self.value = value


class StateDictNode:
    """A module state dict with its ``_metadata`` (per-submodule versions used by load_state_dict)."""

    __slots__ = ("items", "metadata")

    def __init__(self, items: dict[Any, Any], metadata: Any) -> None:
        self.items = items
        self.metadata = metadata


class DTypeNode:
    """A ``torch.dtype`` value, stored by its torch name (format.dtypes)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class NumpyScalarNode:
    """A NumPy scalar, stored as its dtype string (``dtype.str``) and raw bytes."""

    __slots__ = ("data", "dtype")

    def __init__(self, dtype: str, data: bytes) -> None:
        self.dtype = dtype
        self.data = data


# What ``dtype.str`` looks like for the scalar kinds a tree stores: bool, signed and
# unsigned ints, floats (longdouble included), complex, timedelta, datetime, str_, bytes_.
# Object and void (structured) scalars are refused: they have no exact byte form.
_NPSCALAR_DTYPE = re.compile(r"[<>|=][biufcmMUS][0-9]{1,9}(\[[0-9]*[A-Za-z]+\])?\Z")


def numpy_scalar_node(value: np.generic) -> NumpyScalarNode | None:
    """The node that stores ``value`` exactly (type and value), or None if none can.

    ``np.str_`` and ``np.bytes_`` are stored as NumPy stores them (UCS-4 code
    points and raw bytes), so a ``np.str_`` may hold any code point.
    """
    dtype = value.dtype
    if dtype.hasobject or not _NPSCALAR_DTYPE.match(dtype.str):
        return None
    # An empty np.str_ has itemsize 0 yet tobytes() returns one NUL code point.
    return NumpyScalarNode(dtype.str, value.tobytes() if dtype.itemsize else b"")


@functools.lru_cache(maxsize=256)
def _numpy_scalar_dtype(name: str) -> np.dtype[Any] | None:
    """The dtype a stored NumPy scalar names, or None if a tree may not hold it."""
    if not _NPSCALAR_DTYPE.match(name):
        return None
    try:
        return np.dtype(name)
    except (TypeError, ValueError):  # the pattern admits strings NumPy refuses ("|b9")
        return None


def _decode_numpy_scalar(pair: Any, where: str) -> np.generic:
    if not (
        type(pair) is list
        and len(pair) == 2
        and type(pair[0]) is str
        and type(pair[1]) is bytes
        and (dtype := _numpy_scalar_dtype(pair[0])) is not None
    ):
        raise CorruptCheckpointError(f"{where}: malformed NumPy scalar")
    raw = pair[1]
    if len(raw) != dtype.itemsize:
        raise CorruptCheckpointError(
            f"{where}: NumPy scalar of dtype {dtype.str} has {len(raw)} bytes, not {dtype.itemsize}"
        )
    if not raw:  # only an empty np.str_ or np.bytes_
        empty: np.generic = dtype.type()
        return empty
    return np.frombuffer(raw, dtype=dtype)[0]  # type: ignore[no-any-return]


_EXT_TENSOR = 1
_EXT_NDARRAY = 2
_EXT_TUPLE = 3
_EXT_BIGINT = 4
_EXT_STATE_DICT = 5
_EXT_DTYPE = 6
_EXT_NPSCALAR = 7


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, TensorRef):
        code = _EXT_NDARRAY if obj.numpy else _EXT_TENSOR
        return msgspec.msgpack.Ext(code, obj.name.encode())
    if isinstance(obj, TupleNode):
        return msgspec.msgpack.Ext(_EXT_TUPLE, _ENCODER.encode(obj.items))
    if isinstance(obj, BigInt):
        return msgspec.msgpack.Ext(_EXT_BIGINT, str(obj.value).encode())
    if isinstance(obj, StateDictNode):
        payload = [list(obj.items.items()), list(obj.metadata.items())]
        return msgspec.msgpack.Ext(_EXT_STATE_DICT, _ENCODER.encode(payload))
    if isinstance(obj, DTypeNode):
        return msgspec.msgpack.Ext(_EXT_DTYPE, obj.name.encode())
    if isinstance(obj, NumpyScalarNode):
        return msgspec.msgpack.Ext(_EXT_NPSCALAR, _ENCODER.encode([obj.dtype, obj.data]))
    raise UnsupportedValueError(f"cannot encode {type(obj).__name__}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode_tree(tree: Any) -> bytes:
    """Encode a captured tree (containers, primitives and the node types above) as msgpack."""
    return _ENCODER.encode(tree)


def decode_tree(
    data: bytes,
    tensors: Mapping[str, torch.Tensor],
    *,
    where: str,
) -> Any:
    """Rebuild a state tree, resolving tensor references against ``tensors``.

    Raises CorruptCheckpointError on malformed input or a reference to a missing tensor.
    """

    def ext_hook(code: int, payload: memoryview) -> Any:
        if code in (_EXT_TENSOR, _EXT_NDARRAY):
            name = bytes(payload).decode()
            if name not in tensors:
                raise CorruptCheckpointError(f"{where}: tree refers to missing tensor {name!r}")
            tensor = tensors[name]
            return tensor.numpy() if code == _EXT_NDARRAY else tensor
        if code == _EXT_TUPLE:
            items = decoders[0].decode(payload)
            if not isinstance(items, list):
                raise CorruptCheckpointError(f"{where}: a tuple's payload is not an array")
            return tuple(items)
        if code == _EXT_BIGINT:
            digits = bytes(payload)
            if not _BIGINT.match(digits):
                raise CorruptCheckpointError(f"{where}: malformed big integer")
            return int(digits)
        if code == _EXT_STATE_DICT:
            return _state_dict(decoders[0].decode(payload), where)
        if code == _EXT_DTYPE:
            return _dtype(bytes(payload).decode(), where)
        if code == _EXT_NPSCALAR:
            return _decode_numpy_scalar(decoders[0].decode(payload), where)
        raise CorruptCheckpointError(f"{where}: unknown tree extension type {code}")

    decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(ext_hook=ext_hook)
    # ext_hook reaches the decoder through this list, emptied after decoding: a closure
    # over ``decoder`` itself is a cycle (decoder -> ext_hook -> decoder) that keeps
    # ``tensors`` (a whole loaded file) alive until the garbage collector runs.
    decoders = [decoder]
    try:
        tree = decoder.decode(data)
    except CorruptCheckpointError:
        raise
    except RecursionError:
        raise CorruptCheckpointError(
            f"{where}: state tree nested deeper than {tunables.MAX_TREE_DEPTH} containers"
        ) from None
    except (msgspec.DecodeError, ValueError, TypeError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(f"{where}: malformed state tree ({exc})") from exc
    finally:
        decoders.clear()
    _check_decoded(tree, where)
    return tree


# ASCII decimal digits with an optional "-", at most the digits int() accepts by default.
_BIGINT = re.compile(rb"-?[0-9]{1,4300}\Z")
# The exact types decoding builds (NumPy scalars aside); anything else is refused.
_CONTAINER_TYPES = frozenset({dict, list, tuple, OrderedDict})
_LEAF_TYPES = frozenset(
    {type(None), bool, int, float, str, bytes, torch.Tensor, torch.dtype, np.ndarray}
)
_LEAF_SUBCLASSES = (np.generic, torch.Tensor, np.ndarray)
_KEY_TYPES = frozenset({str, int})


def _state_dict(payload: Any, where: str) -> OrderedDict[Any, Any]:
    """A module state dict from ``[[[key, value], ...], [[prefix, versions], ...]]``."""
    if not (isinstance(payload, list) and len(payload) == 2):
        raise CorruptCheckpointError(f"{where}: malformed module state dict")
    parts: list[OrderedDict[Any, Any]] = []
    for pairs in payload:
        if not isinstance(pairs, list) or not all(
            isinstance(p, list) and len(p) == 2 and type(p[0]) in (str, int) for p in pairs
        ):
            raise CorruptCheckpointError(f"{where}: malformed module state dict")
        parts.append(OrderedDict(pairs))
    state, metadata = parts
    # torch keeps a state dict's per-module versions in this attribute (load_state_dict reads it)
    state._metadata = metadata  # type: ignore[attr-defined]  # noqa: SLF001 - torch's convention
    return state


def _check_decoded(tree: Any, where: str) -> None:
    """Refuse what capture never writes: containers nested deeper than tunables.MAX_TREE_DEPTH,
    map keys other than str and int, and values of any other type (msgpack timestamps).

    Iterative, so a deep tree cannot exhaust the stack here.
    """
    stack: list[tuple[Any, int]] = [([tree], 0)]  # a list around the root, at level 0
    push = stack.append
    containers, leaves = _CONTAINER_TYPES, _LEAF_TYPES
    while stack:
        value, level = stack.pop()
        if level > tunables.MAX_TREE_DEPTH:
            raise CorruptCheckpointError(
                f"{where}: state tree nested deeper than {tunables.MAX_TREE_DEPTH} containers"
            )
        if isinstance(value, dict):
            if not {type(key) for key in value} <= _KEY_TYPES:
                raise CorruptCheckpointError(f"{where}: a map key is neither str nor int")
            metadata = getattr(value, "_metadata", None) if type(value) is not dict else None
            if metadata is not None:  # a module state dict's, one level below it
                push((metadata, level + 1))
            value = value.values()
        for item in value:
            kind = type(item)
            if kind in leaves:
                continue
            if kind in containers:
                push((item, level + 1))
            elif not isinstance(item, _LEAF_SUBCLASSES):
                raise CorruptCheckpointError(
                    f"{where}: value of type {kind.__name__} in state tree"
                )


def _dtype(text: str, where: str) -> torch.dtype:
    """A tree's dtype value (any torch dtype, not only a storable one)."""
    dtype = decode_dtype(text, storable=False)
    if dtype is None:
        raise CorruptCheckpointError(f"{where}: unknown dtype {text!r}")
    return dtype
