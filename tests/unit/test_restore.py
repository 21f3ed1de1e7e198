"""restore(): strict names, checks against the live objects, all or nothing."""

from __future__ import annotations

import copy
import logging
import random
from typing import Any

import pytest
import torch
from torch import nn

import checkpointd
from tests.conftest import Root


def _model(width: int = 8, dtype: torch.dtype = torch.float32) -> nn.Module:
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2)).to(dtype)


def _trained(width: int = 8, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Any]:
    model = _model(width, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4, dtype=dtype)).sum().backward()
    optimizer.step()
    return model, optimizer


def _save(root: Root, state: dict[str, Any], step: int = 1) -> None:
    with checkpointd.CheckpointWriter(root.url, storage_options=root.storage_options) as writer:
        writer.save(step, state).result(timeout=60)


def _restore(root: Root, targets: dict[str, Any], **kwargs: Any) -> checkpointd.RestoreInfo:
    return checkpointd.restore(root.url, targets, storage_options=root.storage_options, **kwargs)


class Counter:
    def __init__(self, count: int = 0) -> None:
        self.count = count

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]


class Picky(Counter):
    """Changes itself, then refuses count 2: the worst case for all-or-nothing."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = -1
        if state["count"] == 2:
            raise ValueError("injected: refused after a partial change")
        self.count = state["count"]


class Checked(Counter):
    def check_state_dict(self, state: dict[str, Any]) -> None:
        if state["count"] > 100:
            raise ValueError("count out of range")


def _snapshot(targets: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of every target's state, taken the way a user would see it."""
    result: dict[str, Any] = {}
    for name, target in targets.items():
        if isinstance(target, torch.Generator):
            result[name] = target.get_state()
        elif isinstance(target, checkpointd.RNGState):
            result[name] = (random.getstate(), torch.get_rng_state())
        else:
            result[name] = copy.deepcopy(target.state_dict())
    return result


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def test_strict_names_every_missing_and_unexpected_component(memory_root: Root) -> None:
    model, optimizer = _trained()
    _save(memory_root, {"model": model, "optimizer": optimizer, "extra": Counter(3)})
    live_model, live_optimizer = _trained()
    targets = {"model": live_model, "optimizer": live_optimizer, "ema": Counter()}
    before = _snapshot(targets)
    with pytest.raises(checkpointd.RestoreMismatchError) as caught:
        _restore(memory_root, targets)
    assert "targets without a component: ['ema']" in str(caught.value)
    assert "components without a target: ['extra']" in str(caught.value)
    _assert_same(before, _snapshot(targets))


def test_non_strict_restores_the_intersection_and_reports_the_rest(
    memory_root: Root, caplog: pytest.LogCaptureFixture
) -> None:
    model, _ = _trained()
    _save(memory_root, {"model": model, "extra": Counter(3)})
    live, ema = _model(), Counter(7)
    with caplog.at_level(logging.WARNING, logger="checkpointd"):
        info = _restore(memory_root, {"model": live, "ema": ema}, strict=False)
    assert isinstance(info, checkpointd.CheckpointInfo)
    assert info.step == 1
    assert info.restored == ("model",)
    assert info.skipped_targets == ("ema",)
    assert info.skipped_components == ("extra",)
    assert "['ema']" in caplog.text
    assert "['extra']" in caplog.text
    assert ema.count == 7
    _assert_same(model.state_dict(), live.state_dict())

    full = _restore(memory_root, {"model": _model(), "extra": Counter()})
    assert (full.restored, full.skipped_targets, full.skipped_components) == (
        ("model", "extra"),
        (),
        (),
    )


@pytest.mark.parametrize(
    ("live_factory", "match"),
    [
        (lambda: _trained(width=16), r"0\.weight: stored \[8, 4\] torch.float32, live \[16, 4\]"),
        (lambda: _trained(dtype=torch.float64), r"float32.*float64"),
    ],
    ids=["shape", "dtype"],
)
def test_module_that_does_not_fit_is_refused_before_anything_changes(
    memory_root: Root, live_factory: Any, match: str
) -> None:
    model, optimizer = _trained()
    _save(memory_root, {"counter": Counter(5), "model": model, "optimizer": optimizer})
    live_model, live_optimizer = live_factory()
    targets = {"counter": Counter(1), "model": live_model, "optimizer": live_optimizer}
    before = _snapshot(targets)
    with pytest.raises(checkpointd.RestoreMismatchError, match=match):
        _restore(memory_root, targets)
    _assert_same(before, _snapshot(targets))


def test_optimizer_with_other_parameter_counts_is_refused(memory_root: Root) -> None:
    _, optimizer = _trained()
    _save(memory_root, {"optimizer": optimizer})
    live = torch.optim.AdamW(list(_model().parameters())[:2], lr=0.1)
    with pytest.raises(checkpointd.RestoreMismatchError, match="group 0: 4 parameter"):
        _restore(memory_root, {"optimizer": live})
    split = _model()
    params = list(split.parameters())
    two_groups = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}])
    with pytest.raises(checkpointd.RestoreMismatchError, match="1 parameter group"):
        _restore(memory_root, {"optimizer": two_groups})


@pytest.mark.parametrize("live_has_state", [False, True])
def test_optimizer_state_of_other_shapes_is_refused(
    memory_root: Root, live_has_state: bool
) -> None:
    # Same parameter count, other widths: torch would load the moments and fail at the
    # next step (or, for a fresh optimizer, silently keep misshapen state).
    _, optimizer = _trained(width=8)
    _save(memory_root, {"optimizer": optimizer})
    if live_has_state:
        _, live = _trained(width=16)
    else:
        live = torch.optim.AdamW(_model(width=16).parameters(), lr=0.1)
    before = copy.deepcopy(live.state_dict())
    with pytest.raises(checkpointd.RestoreMismatchError, match=r"state/0/exp_avg: stored \[8, 4\]"):
        _restore(memory_root, {"optimizer": live})
    _assert_same(before, live.state_dict())


def test_optimizer_state_of_another_dtype_is_refused(memory_root: Root) -> None:
    _, optimizer = _trained(dtype=torch.float64)
    _save(memory_root, {"optimizer": optimizer})
    live = torch.optim.AdamW(_model().parameters(), lr=0.1)  # float32 parameters
    with pytest.raises(checkpointd.RestoreMismatchError, match=r"exp_avg.*float64"):
        _restore(memory_root, {"optimizer": live})


def test_factored_optimizer_state_into_a_fresh_optimizer_is_accepted(memory_root: Root) -> None:
    # Adafactor keeps row/column factors shaped unlike the parameter: not a mismatch.
    torch.manual_seed(0)
    model = _model()
    optimizer = torch.optim.Adafactor(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    _save(memory_root, {"model": model, "optimizer": optimizer})
    live_model = _model()
    live_optimizer = torch.optim.Adafactor(live_model.parameters(), lr=0.01)
    _restore(memory_root, {"model": live_model, "optimizer": live_optimizer})
    _assert_same(optimizer.state_dict(), live_optimizer.state_dict())


def test_scheduler_of_another_class_is_refused(memory_root: Root) -> None:
    _, optimizer = _trained()
    _save(memory_root, {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)})
    _, live_optimizer = _trained()
    live = torch.optim.lr_scheduler.CosineAnnealingLR(live_optimizer, T_max=10)
    before = copy.deepcopy(live.state_dict())
    with pytest.raises(checkpointd.RestoreMismatchError, match="step_size"):
        _restore(memory_root, {"scheduler": live})
    assert live.state_dict() == before


def test_a_target_that_refuses_late_rolls_every_target_back(memory_root: Root) -> None:
    torch.manual_seed(0)
    model, optimizer = _trained()
    generator = torch.Generator().manual_seed(1)
    _save(
        memory_root,
        {
            "model": model,
            "optimizer": optimizer,
            "generator": generator,
            "rng": checkpointd.RNGState(),
            "picky": Counter(2),
        },
    )
    torch.manual_seed(3)
    random.seed(3)
    live_model, live_optimizer = _trained()
    targets = {
        "model": live_model,
        "optimizer": live_optimizer,
        "generator": torch.Generator().manual_seed(4),
        "rng": checkpointd.RNGState(),
        "picky": Picky(9),
    }
    before = _snapshot(targets)
    with pytest.raises(checkpointd.RestoreMismatchError, match=r"'picky' was rejected.*injected"):
        _restore(memory_root, targets)
    # Model, optimizer, generator and RNG were loaded, then put back; picky too.
    _assert_same(before, _snapshot(targets))
    assert targets["picky"].count == 9


def test_check_state_dict_refusal_stops_before_anything_changes(memory_root: Root) -> None:
    model, _ = _trained()
    _save(memory_root, {"model": model, "checked": Counter(500)})
    live = _model()
    before = copy.deepcopy(live.state_dict())
    checked = Checked(1)
    with pytest.raises(checkpointd.RestoreMismatchError, match=r"'checked'.*out of range"):
        _restore(memory_root, {"model": live, "checked": checked})
    _assert_same(before, live.state_dict())
    assert checked.count == 1


class Stubborn(Counter):
    """Refuses every state, its own backup included."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise ValueError("injected: refuses everything")


def test_a_failed_rollback_is_reported_not_hidden(memory_root: Root) -> None:
    _save(memory_root, {"a": Counter(1)})
    with pytest.raises(checkpointd.CheckpointError, match="rolling back also failed") as caught:
        _restore(memory_root, {"a": Stubborn()})
    assert not isinstance(caught.value, checkpointd.RestoreMismatchError)
