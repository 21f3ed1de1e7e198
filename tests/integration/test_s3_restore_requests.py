"""A restore from S3 (moto over HTTP) makes O(files) requests, counted as the S3 calls
sent through s3fs and through the store's sync client (``SyncS3.once``): the step listing, the manifest (HEAD and GET), then one ranged GET per
``S3_READ_PART_BYTES`` of each file it needs; no HEAD of a file whose size the manifest
gives (each GET's Content-Range carries it). Long files go as concurrent ranged GETs,
at most ``S3_READ_PARALLEL`` in flight."""

from __future__ import annotations

import collections
import math
import threading
from typing import Any

import pytest
import s3fs
import torch

import checkpointd
from checkpointd import tunables
from checkpointd.read import catalog
from checkpointd.storage import open_store
from checkpointd.storage.s3client import SyncS3
from tests.conftest import Root


def _state(width: int = 32) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4)))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return model, optimizer


class _Calls:
    """Counts the S3 calls sent (through s3fs and the sync client) by operation, and the
    most in flight at once."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.made: collections.Counter[str] = collections.Counter()
        self.in_flight = self.peak = 0
        self._lock = threading.Lock()
        original = s3fs.S3FileSystem._call_s3  # noqa: SLF001 - counts the calls s3fs sends
        original_once = SyncS3.once

        async def counted(fs: Any, method: str, *args: Any, **kwargs: Any) -> Any:
            self._start(method)
            try:
                return await original(fs, method, *args, **kwargs)
            finally:
                self._end()

        def counted_once(client: SyncS3, method: str, **kwargs: Any) -> Any:
            self._start(method)
            try:
                return original_once(client, method, **kwargs)
            finally:
                self._end()

        monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counted)
        monkeypatch.setattr(SyncS3, "once", counted_once)

    def _start(self, method: str) -> None:
        with self._lock:
            self.made[method] += 1
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)

    def _end(self) -> None:
        with self._lock:
            self.in_flight -= 1


def _save(root: Root, width: int = 32) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, optimizer = _state(width)
    with checkpointd.CheckpointWriter(root.url, storage_options=root.storage_options) as w:
        w.save(1, {"model": model, "optimizer": optimizer}).result(timeout=60)
    return model, optimizer


def test_restore_makes_one_get_per_file_and_no_head_but_the_manifests(
    s3_root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _ = _save(s3_root)
    calls = _Calls(monkeypatch)
    live_model, live_optimizer = _state()
    checkpointd.restore(
        s3_root.url,
        {"model": live_model, "optimizer": live_optimizer},
        storage_options=s3_root.storage_options,
    )
    files = 2 * 2  # two components, a tree and a tensor file each
    assert calls.made.pop("list_objects_v2", 0) <= 1  # the step listing
    assert calls.made.pop("head_bucket", 0) <= 1  # the store checks its bucket on opening
    assert calls.made.pop("head_object") == 1  # the manifest's size
    assert calls.made.pop("get_object") == files + 1  # + the manifest
    assert not calls.made, calls.made
    for key, value in model.state_dict().items():
        assert torch.equal(live_model.state_dict()[key], value)


def test_long_files_are_read_as_concurrent_bounded_ranges(
    s3_root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = _save(s3_root, width=256)
    part = 64 * 1024
    monkeypatch.setattr(tunables, "S3_READ_PART_BYTES", part)
    monkeypatch.setattr(tunables, "S3_READ_PARALLEL", 3)
    store = open_store(s3_root.url, s3_root.storage_options)
    manifest = catalog.read_manifest(store, 1)
    store.close()
    ranges = sum(math.ceil(f.size / part) for f in manifest.files)
    assert ranges > 2 * len(manifest.files)  # the tensor files take several ranges each
    calls = _Calls(monkeypatch)
    live_model, live_optimizer = _state(width=256)
    checkpointd.restore(
        s3_root.url,
        {"model": live_model, "optimizer": live_optimizer},
        storage_options=s3_root.storage_options,
    )
    assert calls.made["get_object"] == ranges + 1  # + the manifest
    assert calls.made["head_object"] == 1
    assert 2 <= calls.peak <= 3
    for key, value in model.state_dict().items():
        assert torch.equal(live_model.state_dict()[key], value)
    saved = optimizer.state_dict()["state"]
    for index, state in live_optimizer.state_dict()["state"].items():
        assert torch.equal(state["exp_avg"], saved[index]["exp_avg"])


def test_a_truncated_object_is_a_size_mismatch(
    s3_root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(s3_root)
    store = open_store(s3_root.url, s3_root.storage_options)
    manifest = catalog.read_manifest(store, 1)
    store.close()
    (victim,) = [f for f in manifest.files if f.path.startswith("model") and "tensors" in f.path]
    fs = s3fs.S3FileSystem(**s3_root.storage_options)
    key = f"{s3_root.url.removeprefix('s3://')}/{1:012d}/{victim.path}"
    fs.pipe_file(key, fs.cat_file(key)[: victim.size // 2])
    live_model, live_optimizer = _state()
    with pytest.raises(checkpointd.CorruptCheckpointError, match=r"size .* does not match"):
        checkpointd.restore(
            s3_root.url,
            {"model": live_model, "optimizer": live_optimizer},
            step=1,
            storage_options=s3_root.storage_options,
        )
