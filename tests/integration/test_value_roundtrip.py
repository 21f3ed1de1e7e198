"""Awkward values through a real writer and ``checkpointd.load`` on local disk.

Every value ``save()`` accepts must come back exactly (type and value); every
value the background could not write must be refused by ``save()`` itself,
with its path, as UnsupportedValueError. A failure in the background, after
``save()`` returned, is the bug these tests guard against.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import checkpointd
from checkpointd import tunables
from checkpointd.errors import UnsupportedValueError
from tests.support.torch_private import neg_view, set_state_dict_metadata, state_dict_metadata


def _round_trip(tmp_path: Path, state: dict[str, Any]) -> dict[str, Any]:
    root = str(tmp_path / "ckpt")
    with checkpointd.CheckpointWriter(root) as writer:
        writer.save(1, state).result(timeout=60)
    return checkpointd.load(root, 1, verify=True).state


def _refused(tmp_path: Path, state: dict[str, Any], match: str) -> None:
    root = str(tmp_path / "ckpt")
    with checkpointd.CheckpointWriter(root) as writer:
        with pytest.raises(UnsupportedValueError, match=match):
            writer.save(1, state)
        writer.wait(timeout=60)  # nothing pending failed in the background either
    assert checkpointd.list_checkpoints(root) == []


# -- 1. conjugate and negative views are values, not aliases of their base ---------------


def _complex() -> torch.Tensor:
    return torch.tensor([1 + 2j, 3 - 4j, -5 + 0.5j], dtype=torch.complex64)


def _views() -> dict[str, Any]:
    c = _complex()
    x = torch.tensor([1.0, -2.0, 3.5])
    return {
        "conj": {"base": c, "view": c.conj()},
        "conj-first": {"view": c.conj(), "base": c},
        "conj-physical": {"base": c, "view": torch.conj_physical(c)},
        "neg": {"base": x, "view": neg_view(x)},
        "conj-imag": {"base": c.imag, "view": c.conj().imag},  # a negative view of c.imag
        "conj-real": {"base": c.real, "view": c.conj().real},  # no sign change: may share
        "conj-of-conj": {"base": c, "view": c.conj().conj()},
        "both-views": {"a": c.conj(), "b": c.conj(), "c": c},
    }


@pytest.mark.parametrize("case", list(_views()))
def test_conjugate_and_negative_views_round_trip_as_values(tmp_path: Path, case: str) -> None:
    saved = _views()[case]
    expected = {k: v.resolve_conj().resolve_neg().clone() for k, v in saved.items()}
    loaded = _round_trip(tmp_path, {"c": saved})["c"]
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        assert loaded[key].dtype == value.dtype
        assert torch.equal(loaded[key], value), (case, key, loaded[key], value)
        assert not loaded[key].is_conj()
        assert not loaded[key].is_neg()


def test_a_conjugate_view_still_shares_with_an_identical_view(tmp_path: Path) -> None:
    c = _complex()
    loaded = _round_trip(tmp_path, {"c": {"a": c.conj(), "b": c.conj(), "base": c}})["c"]
    assert loaded["a"].data_ptr() == loaded["b"].data_ptr()  # still stored once
    assert loaded["a"].data_ptr() != loaded["base"].data_ptr()


# -- 2. NumPy scalars and subclasses of the primitives -----------------------------------

_NUMPY_SCALARS: dict[str, Any] = {
    "bool_": np.bool_(True),
    "int8": np.int8(-7),
    "int16": np.int16(-300),
    "int32": np.int32(-(2**31)),
    "int64": np.int64(-(2**63)),
    "uint8": np.uint8(255),
    "uint16": np.uint16(65535),
    "uint32": np.uint32(2**32 - 1),
    "uint64": np.uint64(2**64 - 1),
    "float16": np.float16(1.5),
    "float32": np.float32(-0.1),
    "float64": np.float64(0.1),
    "float64-nan": np.float64("nan"),
    "longdouble": np.longdouble(1) / np.longdouble(3),
    "complex64": np.complex64(1 - 2j),
    "complex128": np.complex128(0.1 + 0.2j),
    "str_": np.str_("naïve ☃"),
    "str_-empty": np.str_(""),
    "str_-surrogate": np.str_("\udcff"),  # UCS-4 in NumPy: stored exactly, no UTF-8 involved
    "bytes_": np.bytes_(b"\x00\xff raw"),
    "bytes_-empty": np.bytes_(b""),
    "datetime64": np.datetime64("2024-02-29T12:34:56.789", "ms"),
    "datetime64-nat": np.datetime64("NaT"),
    "timedelta64": np.timedelta64(-3, "D"),
}


@pytest.mark.parametrize("case", list(_NUMPY_SCALARS))
def test_every_numpy_scalar_round_trips_exactly(tmp_path: Path, case: str) -> None:
    value = _NUMPY_SCALARS[case]
    loaded = _round_trip(tmp_path, {"c": {"v": value, "in": [value, (value,)]}})["c"]
    for got in (loaded["v"], loaded["in"][0], loaded["in"][1][0]):
        assert type(got) is type(value)
        assert got.dtype == value.dtype
        assert got.tobytes() == value.tobytes() or got == value


def test_numpy_void_scalars_are_refused_at_save(tmp_path: Path) -> None:
    record = np.zeros(1, dtype=[("a", "i4"), ("b", "f8")])[0]
    _refused(tmp_path, {"c": {"v": record}}, r"c/v: NumPy scalar of dtype")


class _Colour(enum.IntEnum):
    RED = 3


class _Flag(enum.IntFlag):
    A = 1
    B = 2


class _Text(str):
    def __str__(self) -> str:
        return "not the value"


class _Ratio(float):
    def __float__(self) -> float:
        return -1.0


class _Blob(bytes):
    pass


class _Count(int):
    pass


@pytest.mark.parametrize(
    ("value", "plain"),
    [
        (_Colour.RED, 3),
        (_Flag.A | _Flag.B, 3),
        (_Count(2**64 - 1), 2**64 - 1),
        (_Count(2**70), 2**70),
        (_Text("abc"), "abc"),
        (_Ratio(0.25), 0.25),
        (_Blob(b"\x01\x02"), b"\x01\x02"),
    ],
    ids=["IntEnum", "IntFlag", "int-sub", "int-sub-big", "str-sub", "float-sub", "bytes-sub"],
)
def test_subclasses_of_primitives_are_stored_as_the_plain_value(
    tmp_path: Path, value: Any, plain: Any
) -> None:
    as_key = isinstance(value, str) or (isinstance(value, int) and value < 2**64)
    loaded = _round_trip(tmp_path, {"c": {"v": value, "k": {value: 1} if as_key else {}}})["c"]
    assert type(loaded["v"]) is type(plain)
    assert loaded["v"] == plain
    if as_key:  # keys are str or 64-bit int
        [key] = loaded["k"]
        assert type(key) is type(plain)
        assert key == plain


# -- 4. lone surrogates -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"c": {"files": ["ok", "bad-\udcff.txt"]}}, r"c/files/1: string 'bad-\\udcff.txt"),
        ({"c": {"d": {"bad-\udcff": 1}}}, r"c/d: dict key 'bad-\\udcff'"),
        ({"c": _Text("\ud800")}, r"c: string '\\ud800'"),
    ],
    ids=["value", "key", "str-subclass"],
)
def test_lone_surrogates_are_refused_at_save(
    tmp_path: Path, state: dict[str, Any], match: str
) -> None:
    _refused(tmp_path, state, match)


# -- 5. nesting depth ---------------------------------------------------------------------


def _nested(levels: int) -> list[Any]:
    tree: list[Any] = [torch.ones(2)]
    for _ in range(levels - 1):
        tree = [tree]
    return tree


def test_a_tree_at_the_depth_limit_round_trips(tmp_path: Path) -> None:
    loaded = _round_trip(tmp_path, {"c": _nested(tunables.MAX_TREE_DEPTH)})["c"]
    for _ in range(tunables.MAX_TREE_DEPTH - 1):
        loaded = loaded[0]
    assert torch.equal(loaded[0], torch.ones(2))


@pytest.mark.parametrize("levels", [tunables.MAX_TREE_DEPTH + 1, 400, 5000])
def test_a_deeper_tree_is_refused_at_save_with_the_limit(tmp_path: Path, levels: int) -> None:
    _refused(
        tmp_path, {"c": _nested(levels)}, rf"c/0/0/0/.*: .*deeper than {tunables.MAX_TREE_DEPTH}"
    )


def test_depth_counts_tuples(tmp_path: Path) -> None:
    deep: Any = ()
    for _ in range(tunables.MAX_TREE_DEPTH):
        deep = (deep,)
    _refused(tmp_path, {"c": {"t": deep}}, f"deeper than {tunables.MAX_TREE_DEPTH}")


def _module_state_at(levels: int) -> list[Any]:
    """A module state dict whose ``_metadata`` entries sit ``levels`` containers deep."""
    state: OrderedDict[str, Any] = OrderedDict(w=torch.ones(1))
    set_state_dict_metadata(state, OrderedDict({"": {"version": 1}}))
    tree: Any = state
    for _ in range(levels - 3):  # the state dict, its _metadata and the version dict
        tree = [tree]
    return tree


def test_module_metadata_counts_towards_the_depth(tmp_path: Path) -> None:
    loaded = _round_trip(tmp_path, {"c": _module_state_at(tunables.MAX_TREE_DEPTH)})["c"]
    for _ in range(tunables.MAX_TREE_DEPTH - 3):
        loaded = loaded[0]
    assert state_dict_metadata(loaded) == {"": {"version": 1}}
    _refused(
        tmp_path / "deeper", {"c": _module_state_at(tunables.MAX_TREE_DEPTH + 1)}, "deeper than"
    )


# -- other values that passed save() and failed (or lost data) in the background ---------


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (10**5000, "wider than 4096 bits"),
        (_Count(-(10**5000)), "wider than 4096 bits"),
        (np.ma.masked_array([1, 2, 3], mask=[0, 1, 0]), "masked arrays"),
        (torch.empty(3, 2**62, 0), "too large to store"),
    ],
    ids=["huge-int", "huge-int-subclass", "masked-array", "empty-tensor-huge-shape"],
)
def test_other_unwritable_values_are_refused_at_save(
    tmp_path: Path, value: Any, match: str
) -> None:
    _refused(tmp_path, {"c": {"v": value}}, rf"c/v: .*{match}")


def test_an_int_of_4096_bits_round_trips(tmp_path: Path) -> None:
    value = -(2**4096 - 1)
    assert _round_trip(tmp_path, {"c": {"v": value}})["c"]["v"] == value
