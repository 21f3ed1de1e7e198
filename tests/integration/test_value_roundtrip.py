"""Awkward values through a real writer and ``checkpointd.load`` on local disk.

Every value ``save()`` accepts must come back exactly (type and value); every
value the background could not write must be refused by ``save()`` itself,
with its path, as UnsupportedValueError. A failure in the background, after
``save()`` returned, is the bug these tests guard against.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import checkpointd
from checkpointd.errors import UnsupportedValueError


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
        "neg": {"base": x, "view": torch._neg_view(x)},
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
