"""Parallel multipart uploads to S3 (moto over HTTP): invisible until commit, exact, abortable."""

from __future__ import annotations

import pytest

from checkpointd.errors import StorageNotFoundError
from checkpointd.storage import FsspecStore, open_store
from tests.conftest import Root
from tests.support.s3 import MotoS3

PART = 5 * 2**20


@pytest.fixture
def store(s3_root: Root, monkeypatch: pytest.MonkeyPatch) -> FsspecStore:
    monkeypatch.setattr(FsspecStore, "block_size", PART)
    store = open_store(s3_root.url, s3_root.storage_options)
    assert isinstance(store, FsspecStore)
    return store


def _uploads(moto_s3: MotoS3, s3_root: Root) -> list[object]:
    bucket = s3_root.url.removeprefix("s3://").split("/")[0]
    return list(moto_s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []))


def test_parts_go_up_in_parallel_and_appear_only_on_commit(
    store: FsspecStore, moto_s3: MotoS3, s3_root: Root
) -> None:
    data = bytes(range(251)) * (PART // 251 * 4 + 17)  # four full parts and a tail
    sink = store.open_file("f.bin")
    for start in range(0, len(data), 3 * 2**20):
        sink.write(data[start : start + 3 * 2**20])
    assert not store.exists("f.bin")
    assert len(_uploads(moto_s3, s3_root)) == 1
    sink.commit()
    assert store.read_bytes("f.bin") == data
    assert _uploads(moto_s3, s3_root) == []


def test_discard_aborts_the_upload(store: FsspecStore, moto_s3: MotoS3, s3_root: Root) -> None:
    sink = store.open_file("gone.bin")
    sink.write(b"x" * (3 * PART))
    sink.discard()
    assert _uploads(moto_s3, s3_root) == []
    assert not store.exists("gone.bin")


def test_small_file_is_one_put(store: FsspecStore, moto_s3: MotoS3, s3_root: Root) -> None:
    sink = store.open_file("small.bin")
    sink.write(b"abc")
    assert _uploads(moto_s3, s3_root) == []
    sink.commit()
    assert store.read_bytes("small.bin") == b"abc"


def test_backend_errors_are_storage_errors(
    s3_root: Root, moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(FsspecStore, "block_size", PART)
    store = open_store(s3_root.url, s3_root.storage_options)
    moto_s3.client().delete_bucket(Bucket=s3_root.url.removeprefix("s3://").split("/")[0])
    sink = store.open_file("f.bin")
    with pytest.raises(StorageNotFoundError, match="upload"):
        sink.write(b"y" * (2 * PART))  # the first full part creates the upload: no bucket
    sink.discard()
