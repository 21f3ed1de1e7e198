"""A restore from S3 (moto over HTTP) makes O(files) requests: a listing, the manifest,
then one size check and one read per file it needs; no header reads of their own."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch

import checkpointd
from checkpointd.storage.fsspec import FsspecStore
from tests.conftest import Root


def _state() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(4)))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 32)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_restore_requests_are_one_size_and_one_read_per_file(
    s3_root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = _state()
    with checkpointd.CheckpointWriter(s3_root.url, storage_options=s3_root.storage_options) as w:
        w.save(1, {"model": model, "optimizer": optimizer}).result(timeout=60)
    calls: collections.Counter[str] = collections.Counter()
    for name in ("size", "read_into", "list_dir", "exists"):
        original = getattr(FsspecStore, name)

        def counted(self: Any, *args: Any, _original: Any = original, _name: str = name) -> Any:
            calls[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(FsspecStore, name, counted)
    live_model, live_optimizer = _state()
    checkpointd.restore(
        s3_root.url,
        {"model": live_model, "optimizer": live_optimizer},
        storage_options=s3_root.storage_options,
    )
    made = dict(calls)
    files = 2 * 2  # two components, a tree and a tensor file each
    assert made.get("list_dir", 0) <= 1  # the step listing
    assert made["read_into"] == files + 1  # + the manifest
    assert made["size"] <= files + 1
    assert made.get("exists", 0) == 0
    for key, value in model.state_dict().items():
        assert torch.equal(live_model.state_dict()[key], value)
