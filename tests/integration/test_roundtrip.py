"""Save and load back through the public API, on every backend."""

from __future__ import annotations

import torch

import checkpointd
from tests.conftest import Root


def _state() -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 16)).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer, "extra": {"epoch": 3, "name": "run-1"}}


def test_save_then_load_is_bit_exact(any_root: Root) -> None:
    state = _state()
    with checkpointd.CheckpointWriter(any_root.url, storage_options=any_root.storage_options) as w:
        info = w.save(7, state, metrics={"loss": 0.25}).result(timeout=60)
    assert info.step == 7
    assert info.metrics == {"loss": 0.25}

    loaded = checkpointd.load(any_root.url, storage_options=any_root.storage_options)
    assert loaded.info.step == 7
    model = state["model"]
    assert isinstance(model, torch.nn.Module)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state["model"][key], value), key
    assert loaded.state["extra"] == {"epoch": 3, "name": "run-1"}
    steps = [
        c.step
        for c in checkpointd.list_checkpoints(
            any_root.url, storage_options=any_root.storage_options
        )
    ]
    assert steps == [7]
