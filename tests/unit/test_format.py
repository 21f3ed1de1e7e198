"""The tensor-file header and the msgpack state tree."""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import pytest
import torch

from checkpointd.errors import CorruptCheckpointError
from checkpointd.format.codec import (
    BigInt,
    DTypeNode,
    NumpyScalarNode,
    StateDictNode,
    TensorRef,
    TupleNode,
    decode_tree,
    encode_tree,
    numpy_scalar_node,
)
from checkpointd.format.header import (
    TensorEntry,
    encode_safetensors_header,
    header_length,
    parse_safetensors_header,
    shape_fits,
)
from tests.support.torch_private import state_dict_metadata


def _entries() -> list[TensorEntry]:
    return [
        TensorEntry("a", torch.float64, (2, 3), 0, 48),
        TensorEntry("b", torch.float32, (5,), 48, 68),
        TensorEntry("c", torch.bool, (), 68, 69),
    ]


def test_header_round_trips_and_aligns_data_to_8_bytes() -> None:
    encoded = encode_safetensors_header(_entries())
    length = header_length(encoded[:8], len(encoded) + 69, where="t")
    assert (8 + length) % 8 == 0
    parsed = parse_safetensors_header(encoded[8 : 8 + length], 69, where="t")
    assert parsed == _entries()


@pytest.mark.parametrize(
    ("offsets", "data_size"),
    [
        ([(0, 48), (52, 72), (72, 73)], 73),  # gap
        ([(0, 48), (44, 64), (64, 65)], 65),  # overlap
        ([(0, 48), (48, 68), (68, 69)], 70),  # trailing bytes
        ([(0, 48), (48, 68), (68, 69)], 60),  # beyond the data region
        ([(0, 40), (40, 60), (60, 61)], 61),  # size does not match shape
    ],
)
def test_header_parser_rejects_inconsistent_offsets(
    offsets: list[tuple[int, int]], data_size: int
) -> None:
    entries = [
        TensorEntry(e.name, e.dtype, e.shape, begin, end)
        for e, (begin, end) in zip(_entries(), offsets, strict=True)
    ]
    encoded = encode_safetensors_header(entries)
    with pytest.raises(CorruptCheckpointError):
        parse_safetensors_header(encoded[8:], data_size, where="t")


def test_header_length_beyond_the_file_is_refused() -> None:
    with pytest.raises(CorruptCheckpointError, match="does not fit"):
        header_length((2**40).to_bytes(8, "little"), 1000, where="t")


def test_tree_round_trips_every_node_type() -> None:
    state: OrderedDict[str, int] = OrderedDict(w=1)
    tree = {
        "none": None,
        "flag": True,
        "int": -(2**63),
        "uint": 2**64 - 1,
        "big": BigInt(-(2**200)),
        "nan": math.nan,
        "inf": -math.inf,
        "text": "ünïcode",
        "raw": b"\x00\xff",
        "tuple": TupleNode([1, TupleNode(["nested"])]),
        "list": [1.5, [2]],
        0: "int key",
        "dtype": DTypeNode("bfloat16"),
        "npscalar": NumpyScalarNode(np.dtype(np.float16).str, np.float16(1.5).tobytes()),
        "module": StateDictNode(dict(state), {"": {"version": 2}}),
        "tensor": TensorRef("t"),
        "array": TensorRef("t", numpy=True),
    }
    tensor = torch.arange(4, dtype=torch.int32)
    out = decode_tree(encode_tree(tree), {"t": tensor}, where="t")
    assert out["none"] is None
    assert out["flag"] is True
    assert out["int"] == -(2**63)
    assert out["uint"] == 2**64 - 1
    assert out["big"] == -(2**200)
    assert math.isnan(out["nan"])
    assert out["inf"] == -math.inf
    assert out["text"] == "ünïcode"
    assert out["raw"] == b"\x00\xff"
    assert out["tuple"] == (1, ("nested",))
    assert out["list"] == [1.5, [2]]
    assert out[0] == "int key"
    assert out["dtype"] is torch.bfloat16
    assert out["npscalar"] == np.float16(1.5)
    assert out["npscalar"].dtype == np.float16
    assert out["module"] == OrderedDict(w=1)
    assert state_dict_metadata(out["module"]) == {"": {"version": 2}}
    assert out["tensor"] is tensor
    assert isinstance(out["array"], np.ndarray)
    assert out["array"].tolist() == [0, 1, 2, 3]


def test_tree_reference_to_a_missing_tensor_is_corrupt() -> None:
    with pytest.raises(CorruptCheckpointError, match="missing tensor"):
        decode_tree(encode_tree({"x": TensorRef("gone")}), {}, where="t")


def test_unknown_extension_type_is_corrupt() -> None:
    import msgspec

    data = msgspec.msgpack.encode(msgspec.msgpack.Ext(99, b""))
    with pytest.raises(CorruptCheckpointError, match="unknown tree extension"):
        decode_tree(data, {}, where="t")


def test_garbage_tree_is_corrupt() -> None:
    with pytest.raises(CorruptCheckpointError):
        decode_tree(b"\xc1\xff\x00", {}, where="t")


@pytest.mark.parametrize(
    ("shape", "fits"),
    [
        ((), True),
        ((0,), True),
        ((2**63 - 1,), True),
        ((2**63,), False),
        ((0, 2**63 - 1), True),
        ((0, 2**62, 2), False),
        ((3, 2**62, 0), False),
        ((0, 2**62, 2**62), False),
        ((-1, 0), False),
        ((2, -2), False),
    ],
)
def test_shape_fits_counts_zeros_as_one(shape: tuple[int, ...], fits: bool) -> None:
    assert shape_fits(shape) is fits


def test_empty_numpy_strings_round_trip() -> None:
    tree = {"s": np.str_(""), "b": np.bytes_(b"")}
    nodes = {k: numpy_scalar_node(v) for k, v in tree.items()}
    out = decode_tree(encode_tree(nodes), {}, where="t")
    assert type(out["s"]) is np.str_
    assert out["s"] == ""
    assert type(out["b"]) is np.bytes_
    assert out["b"] == b""


def test_object_and_void_scalars_have_no_node() -> None:
    record = np.zeros(1, dtype=[("a", "i4")])[0]
    assert numpy_scalar_node(record) is None
    assert numpy_scalar_node(np.void(b"\x00\x01")) is None
