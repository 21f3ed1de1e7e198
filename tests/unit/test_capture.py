"""Capture on the caller thread: validation, staging reuse, aliasing, snapshot isolation."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from checkpointd.errors import UnsupportedValueError
from checkpointd.format.codec import TensorRef
from checkpointd.write.capture import StagingBuffer, capture
from tests.support.torch_private import neg_view


def _staged(buffer: StagingBuffer, component: Any, name: str) -> torch.Tensor:
    entry = next(e for e in component.entries if e.name == name)
    size = entry.end - entry.begin
    raw = bytearray(buffer.view(component.offset + entry.begin, size)) + b"\0"  # never empty
    return torch.frombuffer(raw, dtype=torch.uint8)[:size].view(entry.dtype).view(entry.shape)


def test_snapshot_does_not_follow_later_mutation() -> None:
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    buffer = StagingBuffer()
    [component] = capture({"m": {"w": weight}}, buffer)
    weight.add_(100)
    assert torch.equal(_staged(buffer, component, "w"), torch.arange(6.0).reshape(2, 3))


def test_staging_buffer_is_reused_across_saves() -> None:
    state = {"m": {f"t{i}": torch.randn(64, 64) for i in range(8)}}
    buffer = StagingBuffer()
    capture(state, buffer)
    first = buffer.capacity
    for _ in range(3):
        capture(state, buffer)
    assert buffer.allocations == 1
    assert buffer.capacity == first


def test_tied_tensors_are_stored_once_and_referenced_twice() -> None:
    shared = torch.randn(4, 4)
    [component] = capture(
        {"m": {"embed": shared, "head": shared, "other": shared.clone()}}, buffer := StagingBuffer()
    )
    assert len(component.entries) == 2
    assert isinstance(component.tree["embed"], TensorRef)
    assert component.tree["embed"].name == component.tree["head"].name
    assert torch.equal(_staged(buffer, component, component.tree["head"].name), shared)


def test_non_contiguous_and_zero_size_tensors() -> None:
    base = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    buffer = StagingBuffer()
    [component] = capture({"c": {"t": base.t(), "empty": torch.empty(0, 5)}}, buffer)
    assert torch.equal(_staged(buffer, component, "t"), base.t().contiguous())
    assert _staged(buffer, component, "empty").shape == (0, 5)


def test_tensors_are_laid_out_naturally_aligned() -> None:
    state = {
        "c": {
            "b": torch.ones(3, dtype=torch.bool),
            "d": torch.ones(3, dtype=torch.float64),
            "h": torch.ones(5, dtype=torch.float16),
        }
    }
    [component] = capture(state, StagingBuffer())
    for entry in component.entries:
        assert entry.begin % entry.dtype.itemsize == 0


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (object(), "cannot be stored"),
        ({"x": {1, 2}}, "set"),
        ({(1, 2): 3}, "keys must be str or int"),
        (torch.zeros(2, dtype=torch.complex128), "complex128"),
        (torch.zeros(2).to_sparse(), "dense"),
        (torch.empty(2, device="meta"), "meta"),
        (np.array(["a"]), "NumPy arrays of dtype"),
    ],
)
def test_unstorable_values_fail_before_anything_is_copied(value: Any, message: str) -> None:
    buffer = StagingBuffer()
    with pytest.raises(UnsupportedValueError, match=message):
        capture({"ok": torch.ones(3), "bad": value}, buffer)
    assert buffer.capacity == 0


def test_cycles_are_refused() -> None:
    loop: dict[str, Any] = {}
    loop["self"] = loop
    with pytest.raises(UnsupportedValueError, match="cycle"):
        capture({"c": loop}, StagingBuffer())


@pytest.mark.parametrize("name", ["", "../x", "a/b", "-flag", "x" * 129, 3])
def test_bad_component_names_are_refused(name: Any) -> None:
    with pytest.raises(UnsupportedValueError, match="component name"):
        capture({name: torch.ones(1)}, StagingBuffer())


def test_state_must_be_a_mapping() -> None:
    with pytest.raises(UnsupportedValueError, match="mapping"):
        capture([torch.ones(1)], StagingBuffer())  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.cuda
def test_cuda_sources_are_staged_in_pinned_memory() -> None:
    source = torch.randn(1024, 1024, device="cuda")
    buffer = StagingBuffer()
    [component] = capture({"m": {"w": source}}, buffer)
    source.add_(1)  # after capture returns, the copy is complete
    assert torch.equal(_staged(buffer, component, "w"), (source - 1).cpu())
    assert buffer.capacity > 0
    assert buffer.pinned


@pytest.mark.parametrize("name", ["modèle", "naïve", "x\u00a0y", "\u0661"])
def test_non_ascii_component_names_are_refused_saying_ascii(name: str) -> None:
    with pytest.raises(UnsupportedValueError) as caught:
        capture({name: torch.ones(1)}, StagingBuffer())
    assert "ASCII letters, digits, '_' or '-'" in str(caught.value)


@pytest.mark.parametrize(
    "view",
    [
        lambda c: c.conj(),
        neg_view,
        lambda c: c.conj().conj(),
    ],
    ids=["conj", "neg", "conj-conj"],
)
def test_conjugate_and_negative_views_are_not_aliased_to_their_base(view: Any) -> None:
    base = torch.tensor([1 + 2j, -3 + 0.5j], dtype=torch.complex64)
    buffer = StagingBuffer()
    [component] = capture({"c": {"base": base, "view": view(base)}}, buffer)
    stored = _staged(buffer, component, component.tree["view"].name)
    assert torch.equal(stored, view(base).resolve_conj().resolve_neg())
    assert torch.equal(_staged(buffer, component, component.tree["base"].name), base)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.cuda
def test_cuda_conjugate_and_negative_views_are_staged_resolved() -> None:
    base = torch.randn(4096, dtype=torch.complex64, device="cuda")
    real = torch.randn(4096, device="cuda")
    state = {
        "c": {
            "base": base,
            "conj": base.conj(),
            "neg": neg_view(real),
            "imag": base.conj().imag,
        }
    }
    buffer = StagingBuffer()
    [component] = capture(state, buffer)
    for key, value in state["c"].items():
        stored = _staged(buffer, component, component.tree[key].name)
        assert torch.equal(stored, value.resolve_conj().resolve_neg().cpu()), key
