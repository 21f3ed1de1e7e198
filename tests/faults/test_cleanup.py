"""GC of leftovers: uncommitted folders, temp and unreferenced files, orphan uploads."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import pytest
import torch

import checkpointd
from checkpointd.cli import main as cli
from checkpointd.errors import StorageError
from checkpointd.format.manifest import MANIFEST_NAME
from checkpointd.maintain.cleanup import find_leftovers, remove_leftovers, scan_leftovers
from checkpointd.storage import FsspecStore, LocalStore, PendingUpload, open_store
from tests.conftest import Root
from tests.support.s3 import MotoS3


def _save(root: Root, step: int) -> None:
    with checkpointd.CheckpointWriter(root.url, storage_options=root.storage_options) as writer:
        writer.save(step, {"w": torch.arange(10.0)}).result()


def _write(path: str, data: bytes, *, age: float = 0.0) -> None:
    with open(path, "wb") as f:
        f.write(data)
    if age:
        then = time.time() - age
        os.utime(path, (then, then))


def _listed(folder: str) -> set[str]:
    with open(f"{folder}/{MANIFEST_NAME}", "rb") as f:
        return {entry["path"] for entry in json.loads(f.read())["files"]}


def test_local_leftovers_found_and_removed(local_root: Root) -> None:
    _save(local_root, 1)
    base = local_root.url
    # A crashed save: an uncommitted folder with a temp file and a finished file.
    os.makedirs(f"{base}/000000000002")
    _write(f"{base}/000000000002/w.safetensors.tmp-abcdef", b"x" * 100)
    _write(f"{base}/000000000002/w.1234abcd.safetensors", b"y" * 50)
    # In the committed folder: a stray temp manifest, a dead attempt's file, an old lease.
    _write(f"{base}/000000000001/manifest.json.tmp-123456", b"{}")
    _write(f"{base}/000000000001/w.0badf00d.safetensors", b"z" * 30)
    _write(f"{base}/000000000001/writer.lock", b'{"host": "vm", "pid": 1}')
    store = LocalStore(base)

    leftovers = find_leftovers(store, older_than=0)
    kinds = sorted((x.kind, x.path) for x in leftovers)
    assert kinds == [
        ("temp", "000000000001/manifest.json.tmp-123456"),
        ("uncommitted", "000000000002"),
        ("unreferenced", "000000000001/w.0badf00d.safetensors"),
        ("unreferenced", "000000000001/writer.lock"),
    ]
    assert next(x for x in leftovers if x.kind == "uncommitted").nbytes == 150
    # Nothing is old enough with a long window: a live writer may still own them.
    assert find_leftovers(store, older_than=3600) == []

    remove_leftovers(store, leftovers)
    assert sorted(os.listdir(base)) == ["000000000001"]
    folder = f"{base}/000000000001"
    assert set(os.listdir(folder)) == {MANIFEST_NAME, *_listed(folder)}
    assert find_leftovers(store, older_than=0) == []
    assert checkpointd.load(base).info.step == 1


def test_gc_clears_a_dead_writers_folder_despite_its_fresh_lease(local_root: Root) -> None:
    """An old-style writer.lock of another node (unexpired by its own clock) protects nothing."""
    base = local_root.url
    folder = f"{base}/000000000003"
    os.makedirs(folder)
    lease = {"host": "node-7f3c.cluster", "pid": 27539, "token": "dead", "acquired_at": time.time()}
    _write(f"{folder}/writer.lock", json.dumps(lease).encode(), age=7200)
    _write(f"{folder}/a.safetensors", b"z", age=7200)
    then = time.time() - 7200
    os.utime(folder, (then, then))
    store = LocalStore(base)
    leftovers = find_leftovers(store, older_than=3600)
    assert [(x.kind, x.path) for x in leftovers] == [("uncommitted", "000000000003")]
    remove_leftovers(store, leftovers)
    assert os.listdir(base) == []


def test_young_uncommitted_folder_is_spared(local_root: Root) -> None:
    base = local_root.url
    os.makedirs(f"{base}/000000000003")
    _write(f"{base}/000000000003/a.safetensors", b"z", age=7200)
    _write(f"{base}/000000000003/b.safetensors.tmp-0123", b"z")  # written to just now
    assert find_leftovers(LocalStore(base), older_than=3600) == []


def test_gc_spares_a_just_created_empty_step_folder(local_root: Root) -> None:
    """A save between its mkdir and its first file: the folder's own time dates it."""
    base = local_root.url
    folder = Path(base, f"{7:012d}")
    folder.mkdir(parents=True)
    store = LocalStore(base)
    assert find_leftovers(store, older_than=3600) == []
    then = time.time() - 7200
    os.utime(folder, (then, then))
    assert [(x.kind, x.path) for x in find_leftovers(store, older_than=3600)] == [
        ("uncommitted", folder.name)
    ]


def _no_upload_listing(self: LocalStore) -> list[PendingUpload]:
    raise StorageError(errno.ENOSYS, "ListMultipartUploads: not implemented by this server")


def test_gc_without_upload_listing_cleans_the_rest_and_says_what_it_skipped(
    local_root: Root, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(local_root, 1)
    base = local_root.url
    os.makedirs(f"{base}/000000000002")
    _write(f"{base}/000000000002/w.1234abcd.safetensors", b"y" * 50, age=7200)
    monkeypatch.setattr(LocalStore, "pending_uploads", _no_upload_listing)

    scan = scan_leftovers(LocalStore(base), older_than=0)
    assert [(x.kind, x.path) for x in scan.leftovers] == [("uncommitted", "000000000002")]
    assert len(scan.problems) == 1
    assert "incomplete uploads" in scan.problems[0]
    assert "not implemented" in scan.problems[0]

    assert cli.main(["gc", base, "--older-than", "0"]) == 0
    out, err = capsys.readouterr()
    assert "uncommitted 000000000002" in out
    assert err.splitlines() == [f"checkpointd gc: {scan.problems[0]}"]
    assert cli.main(["gc", base, "--older-than", "0", "--apply"]) == 0
    assert sorted(os.listdir(base)) == ["000000000001"]


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


def test_s3_unreferenced_object_in_committed_folder_removed(s3_root: Root) -> None:
    _save(s3_root, 1)
    store = open_store(s3_root.url, s3_root.storage_options)
    store.publish("000000000001/w.0badf00d.safetensors", b"dead attempt")
    leftovers = find_leftovers(store, older_than=0)
    assert [(x.kind, x.path) for x in leftovers] == [
        ("unreferenced", "000000000001/w.0badf00d.safetensors")
    ]
    remove_leftovers(store, leftovers)
    assert "w.0badf00d.safetensors" not in store.list_dir("000000000001")
    assert find_leftovers(store, older_than=0) == []
    assert checkpointd.load(s3_root.url, storage_options=s3_root.storage_options).info.step == 1


@pytest.mark.parametrize("age", [0.0])
def test_committed_checkpoint_never_listed(local_root: Root, age: float) -> None:
    _save(local_root, 5)
    _save(local_root, 6)
    assert find_leftovers(LocalStore(local_root.url), older_than=age) == []
