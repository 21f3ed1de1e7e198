"""Hostile tree and tensor-header files whose size and digest check out.

The manifest vouches for the bytes (size and CRC32C match), so only the
parsers stand between them and the caller: ``load`` and ``restore`` must
refuse each with CorruptCheckpointError, never a raw RecursionError,
IndexError, TypeError or RuntimeError. Plus hypothesis properties on
``decode_tree`` and ``parse_safetensors_header``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import checkpointd
from checkpointd import tunables
from checkpointd.errors import CorruptCheckpointError
from checkpointd.format.codec import decode_tree
from checkpointd.format.header import parse_safetensors_header
from tests.faults.test_hostile_input import _replace_file, _save
from tests.support.files import component_file

Ext = msgspec.msgpack.Ext


def _pack(value: Any) -> bytes:
    return msgspec.msgpack.encode(value)


def _ext_header(code: int, size: int) -> bytes:
    if size < 2**8:
        return b"\xc7" + size.to_bytes(1, "big") + code.to_bytes(1, "big", signed=True)
    if size < 2**16:
        return b"\xc8" + size.to_bytes(2, "big") + code.to_bytes(1, "big", signed=True)
    return b"\xc9" + size.to_bytes(4, "big") + code.to_bytes(1, "big", signed=True)


def _nested_tuples(levels: int) -> bytes:
    """``levels`` tuple extensions, each holding the next (built without recursion)."""
    data = b"\xc0"
    for _ in range(levels):
        items = b"\x91" + data
        data = _ext_header(3, len(items)) + items
    return data


def _npscalar(dtype: Any, raw: Any) -> bytes:
    return _pack(Ext(7, _pack([dtype, raw])))


HOSTILE_TREES: dict[str, bytes] = {
    "arrays-100k-deep": b"\x91" * 100_000 + b"\xc0",
    "maps-100k-deep": b"\x81\xa1k" * 100_000 + b"\xc0",
    "tuples-3000-deep": _nested_tuples(3000),
    "arrays-one-over-the-limit": b"\x91" * (tunables.MAX_TREE_DEPTH + 1) + b"\xc0",
    "tuples-one-over-the-limit": _nested_tuples(tunables.MAX_TREE_DEPTH + 1),
    "npscalar-empty-payload": _pack(Ext(7, b"")),
    "npscalar-empty-raw": _npscalar("<f8", b""),
    "npscalar-short-raw": _npscalar("<f8", b"\x00" * 3),
    "npscalar-long-raw": _npscalar("<i2", b"\x00" * 4),
    "npscalar-object": _npscalar("|O", b"\x00" * 8),
    "npscalar-structured-object": _npscalar("i4,O", b"\x00" * 12),
    "npscalar-void": _npscalar("|V8", b"\x00" * 8),
    "npscalar-subarray": _npscalar("(2,)<i4", b"\x00" * 8),
    "npscalar-nil-dtype": _npscalar(None, b"\x00" * 8),
    "npscalar-huge-dtype": _npscalar("U99999999999999999999", b""),
    "npscalar-raw-is-text": _npscalar("<f8", "12345678"),
    "npscalar-not-a-pair": _pack(Ext(7, _pack(5))),
    "tuple-of-a-map": _pack(Ext(3, _pack({"a": 1}))),
    "tuple-of-an-int": _pack(Ext(3, _pack(5))),
    "state-dict-bad-items": _pack(Ext(5, _pack([[[1, 2, 3]], []]))),
    "state-dict-not-a-pair": _pack(Ext(5, _pack(5))),
    "state-dict-list-key": _pack(Ext(5, _pack([[[[1], 2]], []]))),
    "dtype-names-a-module": _pack(Ext(6, b"nn")),
    "dtype-bad-utf8": _pack(Ext(6, b"\xff")),
    "bigint-not-decimal": _pack(Ext(4, b"1_000")),
    "bigint-too-long": _pack(Ext(4, b"9" * 5000)),
    "tensor-name-bad-utf8": _pack(Ext(1, b"\xff")),
    "timestamp-extension": _pack(Ext(-1, b"\x00" * 4)),
    "unknown-extension": _pack(Ext(42, b"")),
    "float-key": b"\x81\xcb" + b"\x3f\xf8" + b"\x00" * 6 + b"\x01",
    "nil-key": b"\x81\xc0\x01",
    "truncated": b"\x92\x01",
}


def _tensor_file(header: dict[str, Any], data: bytes = b"") -> bytes:
    return _raw_tensor_file(msgspec.json.encode(header), data)


def _raw_tensor_file(body: bytes, data: bytes = b"") -> bytes:
    body += b" " * (-(len(body) + 8) % 8)
    return len(body).to_bytes(8, "little") + body + data


def _one_tensor(shape: list[int], offsets: tuple[int, int] = (0, 0), dtype: str = "F32") -> bytes:
    return _tensor_file({"w": {"dtype": dtype, "shape": shape, "data_offsets": list(offsets)}})


HOSTILE_HEADERS: dict[str, bytes] = {
    "zero-size-shape-overflowing-int64": _one_tensor([0, 2**62, 2**62]),
    "zero-size-strides-overflow": _one_tensor([0, 2**62, 2]),
    "zero-size-dim-beyond-int64": _one_tensor([0, 2**64 - 1]),
    "negative-dim": _one_tensor([-1, 0]),
    "negative-dims-make-zero": _one_tensor([-2, 0, 3]),
    "shape-larger-than-range": _tensor_file(
        {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, b"\x00" * 8
    ),
    "shape-smaller-than-range": _tensor_file(
        {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}}, b"\x00" * 8
    ),
    "metadata-100k-deep": _raw_tensor_file(
        b'{"__metadata__":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    ),
}


def _checked(root: str) -> None:
    with pytest.raises(CorruptCheckpointError):
        checkpointd.load(root, 1)
    with pytest.raises(CorruptCheckpointError):
        checkpointd.restore(root, {"model": torch.nn.Module()}, 1, strict=False)


@pytest.mark.parametrize("case", list(HOSTILE_TREES))
def test_hostile_tree_file_is_corrupt(tmp_path: Path, case: str) -> None:
    root = str(tmp_path / "ckpt")
    _save(root)
    _replace_file(root, component_file(root, 1, "model", "tree"), HOSTILE_TREES[case])
    _checked(root)


@pytest.mark.parametrize("case", list(HOSTILE_HEADERS))
def test_hostile_tensor_header_is_corrupt(tmp_path: Path, case: str) -> None:
    root = str(tmp_path / "ckpt")
    _save(root)
    _replace_file(root, component_file(root, 1, "model"), HOSTILE_HEADERS[case])
    _checked(root)


# -- properties ------------------------------------------------------------------------

_PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=16)
)


def _with_ext(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    payload = st.binary(max_size=24) | inner.map(_pack)
    dtypes = st.sampled_from(["<f8", "|b1", "<U1", "|S0", "<M8[s]", "|O", "|V4", "x", "<f16"])
    npscalar = st.tuples(dtypes | _leaf, st.binary(max_size=16) | _leaf).map(
        lambda pair: Ext(7, _pack(list(pair)))
    )
    return (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.text(max_size=4) | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.booleans(),
            inner,
            max_size=4,
        )
        | st.builds(Ext, st.integers(-2, 9), payload)
        | npscalar
    )


_structures = st.recursive(_leaf, _with_ext, max_leaves=20)


def _decodes_or_corrupt(data: bytes) -> None:
    tensors = {"t": torch.zeros(2)}
    with contextlib.suppress(CorruptCheckpointError):
        decode_tree(data, tensors, where="fuzz")


@_PROPERTY
@given(st.binary(max_size=512))
def test_decode_tree_random_bytes_only_raise_corrupt(data: bytes) -> None:
    _decodes_or_corrupt(data)


@_PROPERTY
@given(_structures)
def test_decode_tree_random_structures_only_raise_corrupt(tree: Any) -> None:
    _decodes_or_corrupt(_pack(tree))


@_PROPERTY
@given(
    st.integers(0, 3 * tunables.MAX_TREE_DEPTH).flatmap(
        lambda n: st.lists(
            st.sampled_from(["array", "map", "tuple", "state"]), min_size=n, max_size=n
        )
    )
)
def test_decode_tree_refuses_exactly_the_trees_beyond_the_limit(kinds: list[str]) -> None:
    """``kinds`` lists containers from the innermost out; the outermost sits at level 1."""
    data = b"\xc0"
    deepest = len(kinds)
    for i, kind in enumerate(kinds):
        if kind == "array":
            data = b"\x91" + data
        elif kind == "map":
            data = b"\x81\xa1k" + data
        elif kind == "tuple":
            data = _ext_header(3, len(data) + 1) + b"\x91" + data
        else:  # a module state dict {"k": data} with an empty _metadata one level below it
            items = b"\x92\x91\x92\xa1k" + data + b"\x90"
            data = _ext_header(5, len(items)) + items
            deepest = max(deepest, len(kinds) - i + 1)
    if deepest > tunables.MAX_TREE_DEPTH:
        with pytest.raises(CorruptCheckpointError, match=f"deeper than {tunables.MAX_TREE_DEPTH}"):
            decode_tree(data, {}, where="fuzz")
    else:
        decode_tree(data, {}, where="fuzz")


_dims = st.sampled_from([0, 1, 2, 3, 2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1, -1])


@_PROPERTY
@given(
    st.dictionaries(
        st.text(max_size=4),
        st.fixed_dictionaries(
            {
                "dtype": st.sampled_from(["F32", "F64", "U8", "BOOL", "C64"]),
                "shape": st.lists(_dims, max_size=5),
                "data_offsets": st.tuples(st.integers(0, 64), st.integers(0, 64)),
            }
        ),
        max_size=4,
    ),
    st.integers(0, 64),
)
def test_parsed_headers_give_tensors_torch_can_view(header: dict[str, Any], data_size: int) -> None:
    """Whatever the parser accepts, a reader can view as the tensor it describes."""
    try:
        entries = parse_safetensors_header(msgspec.json.encode(header), data_size, where="fuzz")
    except CorruptCheckpointError:
        return
    data = torch.zeros(data_size + 8, dtype=torch.uint8)
    for entry in entries:
        chunk = data[entry.begin : entry.end].clone()
        tensor = chunk.view(entry.dtype).view(entry.shape)
        assert tensor.numel() * entry.dtype.itemsize == entry.end - entry.begin
