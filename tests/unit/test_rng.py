"""RNGState: every global generator captured, restored exactly, refused whole when it does not fit."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from safetensors import safe_open

import checkpointd
from checkpointd.state import rng as rng_module
from tests.support.files import component_file


def _draws() -> tuple[Any, ...]:
    """One draw from every global domain (equal draws <=> equal generator states)."""
    return (
        random.random(),
        random.gauss(0, 1),
        np.random.random(3).tolist(),
        np.random.normal(size=2).tolist(),
        torch.rand(3).tolist(),
        torch.randn(2).tolist(),
    )


def _states() -> tuple[Any, ...]:
    return random.getstate(), np.random.get_state(legacy=False), torch.get_rng_state()


def _assert_states_equal(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    assert a[0] == b[0]
    assert a[1]["bit_generator"] == b[1]["bit_generator"]
    assert np.array_equal(a[1]["state"]["key"], b[1]["state"]["key"])
    assert (a[1]["state"]["pos"], a[1]["has_gauss"], a[1]["gauss"]) == (
        b[1]["state"]["pos"],
        b[1]["has_gauss"],
        b[1]["gauss"],
    )
    assert torch.equal(a[2], b[2])


def test_round_trip_in_memory_continues_every_stream() -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leave a cached gaussian in Python's and NumPy's state
    np.random.normal()
    saved = checkpointd.RNGState().state_dict()
    expected = _draws()
    _draws()  # move every stream on
    checkpointd.RNGState().load_state_dict(saved)
    assert _draws() == expected


def test_round_trip_through_a_checkpoint_without_pickle(tmp_path: Path) -> None:
    random.seed(4)
    np.random.seed(5)
    torch.manual_seed(6)
    root = str(tmp_path / "ckpt")
    with checkpointd.CheckpointWriter(root) as writer:
        writer.save(1, {"rng": checkpointd.RNGState()}).result(timeout=60)
    expected = _draws()
    _draws()
    info = checkpointd.restore(root, {"rng": checkpointd.RNGState()})
    assert info.restored == ("rng",)
    assert _draws() == expected

    # On disk: a msgpack tree of primitives whose only extensions are tensor references
    # (code 1: tensor, 2: ndarray), and a safetensors file for the tensors.
    folder = tmp_path / "ckpt" / f"{1:012d}"
    tree = msgspec.msgpack.decode((folder / component_file(root, 1, "rng", "tree")).read_bytes())
    leaves: list[Any] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                assert isinstance(k, str)
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)
        else:
            leaves.append(value)

    walk(tree)
    for leaf in leaves:
        if isinstance(leaf, msgspec.msgpack.Ext):
            assert leaf.code in (1, 2), leaf
        else:
            assert leaf is None or isinstance(leaf, int | float | str), leaf
    assert set(tree) == {"python", "numpy", "torch", "cuda"}
    with safe_open(str(folder / component_file(root, 1, "rng")), framework="pt") as f:
        assert set(f.keys()) == {"torch", "numpy/keys"}
        assert f.get_tensor("torch").dtype == torch.uint8


@pytest.mark.parametrize("change", ["missing", "unexpected"])
def test_incomplete_or_unknown_payload_is_refused_before_any_change(change: str) -> None:
    payload = checkpointd.RNGState().state_dict()
    if change == "missing":
        del payload["python"]
    else:
        payload["mps"] = []
    random.seed(7)
    np.random.seed(8)
    torch.manual_seed(9)
    before = _states()
    with pytest.raises(checkpointd.RestoreMismatchError, match=r"domains \['(python|mps)'\]"):
        checkpointd.RNGState().load_state_dict(payload)
    _assert_states_equal(before, _states())


def test_cuda_then_but_not_now_is_refused() -> None:
    payload = checkpointd.RNGState().state_dict()
    payload["cuda"] = [torch.get_rng_state()[:16].clone()] * 2  # as if saved with 2 GPUs
    before = _states()
    with pytest.raises(checkpointd.RestoreMismatchError, match="2 CUDA device"):
        checkpointd.RNGState().load_state_dict(payload)
    _assert_states_equal(before, _states())


def test_cuda_now_but_not_then_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    payload = checkpointd.RNGState().state_dict()  # saved without CUDA
    monkeypatch.setattr(rng_module, "_cuda_count", lambda: 1)
    with pytest.raises(
        checkpointd.RestoreMismatchError, match="no CUDA device, this process has 1"
    ):
        checkpointd.RNGState().load_state_dict(payload)


def test_wrong_layout_in_a_domain_is_refused() -> None:
    payload = checkpointd.RNGState().state_dict()
    payload["torch"] = payload["torch"][:100].clone()
    payload["python"]["state"] = payload["python"]["state"][:-1]
    before = _states()
    with pytest.raises(checkpointd.RestoreMismatchError, match="torch") as caught:
        checkpointd.RNGState().load_state_dict(payload)
    assert "python/state" in str(caught.value)
    _assert_states_equal(before, _states())


def test_a_domain_that_fails_to_set_rolls_the_others_back(monkeypatch: pytest.MonkeyPatch) -> None:
    random.seed(10)
    np.random.seed(11)
    payload = checkpointd.RNGState().state_dict()
    random.seed(12)
    np.random.seed(13)
    before = _states()

    def refuse(state: torch.Tensor) -> None:
        raise RuntimeError("injected: torch refused the state")

    monkeypatch.setattr(torch, "set_rng_state", refuse)
    with pytest.raises(checkpointd.RestoreMismatchError, match="injected"):
        checkpointd.RNGState().load_state_dict(payload)
    monkeypatch.undo()
    _assert_states_equal(before, _states())  # Python and NumPy were set, then put back


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_cuda_generator_round_trips(tmp_path: Path) -> None:
    devices = range(torch.cuda.device_count())
    torch.cuda.manual_seed_all(7)
    generator = torch.Generator(device="cuda").manual_seed(3)
    root = str(tmp_path / "ckpt")
    with checkpointd.CheckpointWriter(root) as writer:
        state = {"rng": checkpointd.RNGState(), "gen": generator}
        writer.save(1, state).result(timeout=60)

    def draws() -> list[list[float]]:
        values = [torch.rand(3, device=f"cuda:{i}").tolist() for i in devices]
        return [*values, torch.rand(3, device="cuda", generator=generator).tolist()]

    expected = draws()
    torch.cuda.manual_seed_all(8)
    generator.manual_seed(9)
    checkpointd.restore(root, {"rng": checkpointd.RNGState(), "gen": generator})
    assert draws() == expected
