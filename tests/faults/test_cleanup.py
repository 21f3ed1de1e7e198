"""GC of leftovers: uncommitted folders, stray temp files, stale leases, orphan uploads."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import msgspec
import pytest
import torch

import checkpointd
from checkpointd.cleanup import find_leftovers, remove_leftovers
from checkpointd.lease import LEASE_NAME, Lease
from checkpointd.storage import FsspecStore, LocalStore, open_store
from tests.conftest import Root
from tests.support.s3 import MotoS3


def _save(root: Root, step: int) -> None:
    with checkpointd.CheckpointWriter(root.url, storage_options=root.storage_options) as writer:
        writer.save(step, {"w": torch.arange(10.0)}).result()


def _dead_lease() -> bytes:
    """A fresh lease of a process that has exited, on this host: stale by its pid."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return msgspec.json.encode(Lease(socket.gethostname(), child.pid, "dead", time.time()))


def test_local_leftovers_found_and_removed(local_root: Root) -> None:
    _save(local_root, 1)
    base = local_root.url
    # A crashed save: an uncommitted folder with a temp file and a finished file.
    os.makedirs(f"{base}/000000000002")
    with open(f"{base}/000000000002/w.safetensors.tmp-abcdef", "wb") as f:
        f.write(b"x" * 100)
    with open(f"{base}/000000000002/w.safetensors", "wb") as f:
        f.write(b"y" * 50)
    # A stray temp manifest and a dead writer's lease in the committed folder.
    with open(f"{base}/000000000001/manifest.json.tmp-123456", "wb") as f:
        f.write(b"{}")
    with open(f"{base}/000000000001/{LEASE_NAME}", "wb") as f:
        f.write(_dead_lease())
    store = LocalStore(base)

    leftovers = find_leftovers(store, older_than=0)
    kinds = sorted((x.kind, x.path) for x in leftovers)
    assert kinds == [
        ("lease", f"000000000001/{LEASE_NAME}"),
        ("temp", "000000000001/manifest.json.tmp-123456"),
        ("uncommitted", "000000000002"),
    ]
    assert next(x for x in leftovers if x.kind == "uncommitted").nbytes == 150
    # Nothing is old enough with a long window: a live writer may still own them.
    assert find_leftovers(store, older_than=3600) == []

    remove_leftovers(store, leftovers)
    assert sorted(os.listdir(base)) == ["000000000001"]
    assert sorted(os.listdir(f"{base}/000000000001")) == [
        "manifest.json",
        "w.safetensors",
        "w.tree.msgpack",
    ]
    assert find_leftovers(store, older_than=0) == []
    assert checkpointd.load(base).info.step == 1


def test_live_lease_protects_uncommitted_folder(local_root: Root) -> None:
    base = local_root.url
    os.makedirs(f"{base}/000000000003")
    with open(f"{base}/000000000003/a.safetensors", "wb") as f:
        f.write(b"z")
    live = Lease(socket.gethostname(), os.getpid(), "live", time.time())
    with open(f"{base}/000000000003/{LEASE_NAME}", "wb") as f:
        f.write(msgspec.json.encode(live))
    assert find_leftovers(LocalStore(base), older_than=0) == []


def test_s3_orphan_multipart_upload_aborted(s3_root: Root, moto_s3: MotoS3) -> None:
    _save(s3_root, 1)
    store = open_store(s3_root.url, s3_root.storage_options)
    assert isinstance(store, FsspecStore)
    bucket = s3_root.url.removeprefix("s3://").split("/")[0]
    client = moto_s3.client()
    upload = client.create_multipart_upload(Bucket=bucket, Key="run/000000000002/w.safetensors")
    client.upload_part(
        Bucket=bucket,
        Key="run/000000000002/w.safetensors",
        UploadId=upload["UploadId"],
        PartNumber=1,
        Body=b"p" * 1000,
    )
    # An upload outside the root is not ours.
    client.create_multipart_upload(Bucket=bucket, Key="other/x")

    leftovers = find_leftovers(store, older_than=0)
    assert [(x.kind, x.path) for x in leftovers] == [("upload", "000000000002/w.safetensors")]
    assert find_leftovers(store, older_than=3600) == []
    remove_leftovers(store, leftovers)
    remaining = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert [u["Key"] for u in remaining] == ["other/x"]
    assert checkpointd.load(s3_root.url, storage_options=s3_root.storage_options).info.step == 1


@pytest.mark.parametrize("age", [0.0])
def test_committed_checkpoint_never_listed(local_root: Root, age: float) -> None:
    _save(local_root, 5)
    _save(local_root, 6)
    assert find_leftovers(LocalStore(local_root.url), older_than=age) == []
