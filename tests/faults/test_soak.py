"""Soak: many saves with keep_last=3 into one root, one writer.

Storage stays bounded (three checkpoints), no temp file or multipart upload is
left, and open file descriptors, threads and RSS stay flat after a warm-up.
Default: 60 local saves and 8 S3 saves; slow mode (CHECKPOINTD_SLOW=1): 300 each.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch

import checkpointd
from checkpointd.maintain.cleanup import find_leftovers
from checkpointd.storage import open_store
from tests.conftest import Root
from tests.support.faults import temp_files
from tests.support.s3 import MotoS3

WARMUP = 10


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _resources() -> tuple[int, int, int]:
    return len(os.listdir("/proc/self/fd")), threading.active_count(), _rss_bytes()


def _soak(root: Root, saves: int, fd_slack: int = 2) -> dict[str, Any]:
    """``fd_slack``: sockets a connection pool may still open after the warm-up (S3 over HTTP,
    with moto's server-side sockets in this same process); a leak per save exceeds it."""
    state = {"model": {"w": torch.randn(256, 256), "b": torch.zeros(256)}, "meta": {"n": 0}}
    per_save = 256 * 256 * 4 + 256 * 4
    store = open_store(root.url, root.storage_options)
    baseline: tuple[int, int, int] | None = None
    max_bytes = 0
    with checkpointd.CheckpointWriter(
        root.url, storage_options=root.storage_options, keep_last=3
    ) as writer:
        for step in range(1, saves + 1):
            state["model"]["w"].add_(1.0)
            state["meta"]["n"] = step
            writer.save(step, state).result()
            infos = checkpointd.list_checkpoints(root.url, storage_options=root.storage_options)
            assert [i.step for i in infos] == list(range(max(1, step - 2), step + 1))
            max_bytes = max(max_bytes, sum(i.nbytes for i in infos))
            if step == min(WARMUP, saves // 2):
                baseline = _resources()
        end = _resources()  # while the writer is still open: its threads and files count
    assert baseline is not None
    assert max_bytes <= 3 * (per_save + 4096), "storage grew past three checkpoints"
    assert len(store.list_dir("")) <= 3, store.list_dir("")
    assert find_leftovers(store, older_than=0) == []
    fds, threads, rss = end
    assert fds <= baseline[0] + fd_slack, f"open fds grew from {baseline[0]} to {fds}"
    assert threads <= baseline[1] + 1, f"threads grew from {baseline[1]} to {threads}"
    assert rss - baseline[2] < 64 * 2**20, f"RSS grew by {(rss - baseline[2]) / 2**20:.1f} MiB"
    loaded = checkpointd.load(root.url, storage_options=root.storage_options)
    assert loaded.info.step == saves
    assert torch.equal(loaded.state["model"]["w"], state["model"]["w"])
    return {"fds": (baseline[0], fds), "threads": (baseline[1], threads), "rss": (baseline[2], rss)}


def test_soak_local(local_root: Root) -> None:
    _soak(local_root, 60)
    assert temp_files(local_root.url) == []


@pytest.mark.timeout(120)
def test_soak_s3(s3_root: Root, moto_s3: MotoS3) -> None:
    _soak(s3_root, 8, fd_slack=10)
    bucket = s3_root.url.removeprefix("s3://").split("/")[0]
    assert moto_s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_soak_local_slow(local_root: Root) -> None:
    print("soak local 300:", _soak(local_root, 300))
    assert temp_files(local_root.url) == []


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_soak_s3_slow(s3_root: Root, moto_s3: MotoS3) -> None:
    print("soak s3 300:", _soak(s3_root, 300, fd_slack=10))
    bucket = s3_root.url.removeprefix("s3://").split("/")[0]
    assert moto_s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
