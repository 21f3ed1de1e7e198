"""checkpointd on s3rver, an S3 server that ignores ``If-None-Match`` (like older MinIO,
Ceph RGW and several gateways) and lacks the multipart listing and abort calls.

The store notices (a probe on first publish), never overwrites a manifest, warns
once that concurrent writers of one step are not excluded, and a full save and
load still round-trips.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import checkpointd
from checkpointd.errors import CheckpointExistsError, StorageCapabilityWarning, StorageError
from checkpointd.storage import FsspecStore, open_store
from tests.conftest import Root
from tests.faults.helpers import same
from tests.support.s3rver import S3rver

PART = 5 * 2**20
MANIFEST = "000000000003/manifest.json"


def _store(root: Root) -> FsspecStore:
    store = open_store(root.url, root.storage_options)
    assert isinstance(store, FsspecStore)
    return store


def _get(server: S3rver, root: Root, path: str) -> bytes:
    bucket = root.url.removeprefix("s3://").partition("/")[0]
    body: bytes = server.client().get_object(Bucket=bucket, Key=f"run/{path}")["Body"].read()
    return body


def _put(server: S3rver, root: Root, path: str, data: bytes) -> None:
    bucket = root.url.removeprefix("s3://").partition("/")[0]
    server.client().put_object(Bucket=bucket, Key=f"run/{path}", Body=data)


def test_probe_finds_no_exclusive_create(s3rver_root: Root) -> None:
    store = _store(s3rver_root)
    assert store.exclusive_create is False
    assert store.exclusive_create is False  # cached: probed once
    assert store.list_dir("") == []


def test_publish_never_overwrites_a_manifest(s3rver: S3rver, s3rver_root: Root) -> None:
    theirs = b'{"step": 3, "writer": "theirs"}'
    _put(s3rver, s3rver_root, MANIFEST, theirs)
    store = _store(s3rver_root)
    store.list_dir("000000000003")  # a cached listing must not hide what is there now
    with (
        pytest.raises(CheckpointExistsError),
        pytest.warns(StorageCapabilityWarning, match="not exclusive"),
    ):
        store.publish(MANIFEST, b'{"step": 3, "writer": "ours"}')
    assert _get(s3rver, s3rver_root, MANIFEST) == theirs


def test_publish_warns_once_per_store(s3rver_root: Root) -> None:
    store = _store(s3rver_root)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store.publish("000000000001/manifest.json", b"one")
        store.publish("000000000002/manifest.json", b"two")
    assert [type(w.message) for w in caught] == [StorageCapabilityWarning]
    assert store.read_bytes("000000000002/manifest.json") == b"two"


def test_publish_raced_by_another_writer_is_not_ours(
    s3rver: S3rver, s3rver_root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer's PUT lands between ours and our read-back: we did not win."""
    store = _store(s3rver_root)
    real_pipe = store.fs.pipe_file

    def pipe_then_overwritten(path: str, data: bytes, **kwargs: Any) -> None:
        real_pipe(path, data, **kwargs)
        if path.endswith(MANIFEST):
            _put(s3rver, s3rver_root, MANIFEST, b"theirs")

    monkeypatch.setattr(store.fs, "pipe_file", pipe_then_overwritten)
    with (
        pytest.raises(CheckpointExistsError, match="another writer"),
        pytest.warns(StorageCapabilityWarning),
    ):
        store.publish(MANIFEST, b"ours")
    assert _get(s3rver, s3rver_root, MANIFEST) == b"theirs"


def test_pending_uploads_is_a_storage_error_without_list_multipart_uploads(
    s3rver_root: Root,
) -> None:
    store = _store(s3rver_root)
    with pytest.raises(StorageError, match="list uploads"):
        store.pending_uploads()


def _state(step: int) -> dict[str, Any]:
    big = torch.arange(PART // 4 * 2 + 999, dtype=torch.float32) * step  # three parts
    return {"model": {"w": big, "b": torch.ones(3)}, "meta": {"step": step}}


def test_save_and_load_round_trip(s3rver_root: Root, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FsspecStore, "block_size", PART)
    options = s3rver_root.storage_options
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with checkpointd.CheckpointWriter(s3rver_root.url, storage_options=options) as writer:
            writer.save(1, _state(1)).result(timeout=60)
            writer.save(2, _state(2)).result(timeout=60)
    assert [type(w.message) for w in caught] == [StorageCapabilityWarning]
    steps = [i.step for i in checkpointd.list_checkpoints(s3rver_root.url, storage_options=options)]
    assert steps == [1, 2]
    loaded = checkpointd.load(s3rver_root.url, storage_options=options, verify=True)
    assert loaded.info.step == 2
    assert same(loaded.state, _state(2))
