"""restore() refuses an optimizer state saved by another optimizer type.

The saved state dict has no type, but its parameter groups name the
hyper-parameters of their algorithm (AdamW: betas, eps, amsgrad; SGD: momentum,
dampening, nesterov). A checkpoint that lacks a hyper-parameter the live
optimizer uses is refused, the target untouched; flags torch added over
releases (foreach, fused, ...) may be absent, and extra keys (a newer torch, a
scheduler's) are accepted.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import checkpointd
from tests.conftest import Root

Factory = Callable[[Any], torch.optim.Optimizer]


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01)


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _stepped(factory: Factory) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = factory(model.parameters())
    _step(model, optimizer)
    return model, optimizer


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()


def _save(root: Root, state: Any) -> None:
    with checkpointd.CheckpointWriter(root.url, storage_options=root.storage_options) as writer:
        writer.save(1, {"optimizer": state}).result(timeout=60)


def _restore(root: Root, optimizer: torch.optim.Optimizer) -> None:
    checkpointd.restore(root.url, {"optimizer": optimizer}, storage_options=root.storage_options)


@pytest.mark.parametrize(
    ("saved", "live", "named"),
    [(_adamw, _sgd, "momentum"), (_sgd, _adamw, "betas"), (_adam, _sgd, "nesterov")],
    ids=["adamw-into-sgd", "sgd-into-adamw", "adam-into-sgd"],
)
def test_another_optimizer_type_is_refused_untouched(
    memory_root: Root, saved: Factory, live: Factory, named: str
) -> None:
    _save(memory_root, _stepped(saved)[1])
    model, optimizer = _stepped(live)
    before = copy.deepcopy(optimizer.state_dict())
    with pytest.raises(checkpointd.RestoreMismatchError, match=named):
        _restore(memory_root, optimizer)
    after = optimizer.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert after["state"].keys() == before["state"].keys()
    _step(model, optimizer)  # still usable: no KeyError from a foreign group


def test_adam_into_adamw_is_accepted_and_stays_adamw(memory_root: Root) -> None:
    """Same state and group keys: torch's AdamW is Adam with decoupled weight decay, and
    AdamW.load_state_dict keeps it decoupled whatever the checkpoint says."""
    _, adam = _stepped(_adam)
    _save(memory_root, adam)
    model, adamw = _stepped(_adamw)
    _restore(memory_root, adamw)
    assert adamw.param_groups[0]["decoupled_weight_decay"] is True
    restored, saved = adamw.state_dict()["state"][0], adam.state_dict()["state"][0]
    assert torch.equal(restored["exp_avg"], saved["exp_avg"])
    _step(model, adamw)


def test_same_type_restores_and_steps(memory_root: Root) -> None:
    _, saved = _stepped(_adamw)
    _save(memory_root, saved)
    model, live = _stepped(_adamw)
    _restore(memory_root, live)
    restored, expected = live.state_dict()["state"][1], saved.state_dict()["state"][1]
    assert torch.equal(restored["exp_avg_sq"], expected["exp_avg_sq"])
    _step(model, live)


@pytest.mark.parametrize("drift", ["older-torch", "newer-torch"])
def test_torch_version_drift_in_group_flags_is_accepted(memory_root: Root, drift: str) -> None:
    """An older torch's groups lack flags added since (torch fills them in on load);
    a newer torch's carry flags this one does not know (ignored on load)."""
    _, saved = _stepped(_adamw)
    state = saved.state_dict()
    for group in state["param_groups"]:
        if drift == "older-torch":
            for flag in ("foreach", "fused", "capturable", "differentiable", "maximize"):
                del group[flag]
            del group["decoupled_weight_decay"]
        else:
            group["some_future_flag"] = False
    _save(memory_root, state)
    model, live = _stepped(_adamw)
    _restore(memory_root, live)
    _step(model, live)
