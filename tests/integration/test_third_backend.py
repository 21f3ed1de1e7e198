"""The one-module example backend (tests/support/dict_store.py) through the public API."""

from __future__ import annotations

import uuid

import pytest
import torch

import checkpointd
from checkpointd.errors import CheckpointExistsError
from checkpointd.storage import open_store
from tests.support.dict_store import DictStore


def test_save_load_restore_and_retention_on_dictfs() -> None:
    root = f"dictfs://run-{uuid.uuid4().hex[:8]}"
    model = torch.nn.Linear(4, 3)
    with checkpointd.CheckpointWriter(root, keep_last=2) as writer:
        for step in (1, 2, 3):
            writer.save(step, {"model": model, "extra": {"step": step}}).result(timeout=60)
    assert [c.step for c in checkpointd.list_checkpoints(root)] == [2, 3]
    loaded = checkpointd.load(root)
    assert loaded.info.step == 3
    assert loaded.state["extra"] == {"step": 3}
    assert torch.equal(loaded.state["model"]["weight"], model.weight)
    fresh = torch.nn.Linear(4, 3)
    checkpointd.restore(root, {"model": fresh}, step=2, strict=False)
    assert torch.equal(fresh.weight, model.weight)
    assert isinstance(open_store(root), DictStore)


def test_dictfs_publish_is_exclusive_between_writers() -> None:
    root = f"dictfs://run-{uuid.uuid4().hex[:8]}"
    with checkpointd.CheckpointWriter(root) as writer:
        writer.save(5, {"x": torch.ones(3)}).result(timeout=60)
    with checkpointd.CheckpointWriter(root) as other, pytest.raises(CheckpointExistsError):
        other.save(5, {"x": torch.zeros(3)}).result(timeout=60)
    assert torch.equal(checkpointd.load(root).state["x"], torch.ones(3))
