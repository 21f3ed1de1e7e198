"""Parallel multipart uploads to S3 (moto over HTTP): invisible until commit, exact, abortable."""

from __future__ import annotations

import pytest
import torch

import checkpointd
from checkpointd.errors import StorageFullError, StorageNotFoundError
from checkpointd.storage import FsspecStore, open_store, s3upload
from checkpointd.storage.s3upload import choose_part_size
from tests.conftest import Root
from tests.support.s3 import MotoS3

PART = 5 * 2**20
MiB = 2**20
GiB = 2**30
TiB = 2**40


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


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (None, 16 * MiB),
        (0, 16 * MiB),
        (GiB, 16 * MiB),
        (156 * GiB, 16 * MiB),  # 9,984 parts of 16 MiB
        (157 * GiB, 17 * MiB),
        (TiB, 105 * MiB),
        (5 * TiB, 525 * MiB),
    ],
)
def test_part_size_is_chosen_to_fit_the_part_limit(size: int | None, expected: int) -> None:
    part = choose_part_size(size, 16 * MiB)
    assert part == expected
    assert s3upload.MIN_PART_BYTES <= part <= s3upload.MAX_PART_BYTES
    assert size is None or -(-size // part) <= s3upload.MAX_PARTS


def test_part_size_keeps_within_the_s3_limits() -> None:
    assert choose_part_size(GiB, MiB) == 5 * MiB
    assert choose_part_size(GiB, 8 * GiB) == 5 * GiB


def test_objects_over_5_tib_are_refused_up_front(
    store: FsspecStore, moto_s3: MotoS3, s3_root: Root
) -> None:
    with pytest.raises(StorageFullError, match="5 TiB"):
        choose_part_size(6 * TiB, 16 * MiB)
    with pytest.raises(StorageFullError, match="5 TiB"):
        store.open_file("huge.bin", size=6 * TiB)
    assert _uploads(moto_s3, s3_root) == []


def test_declared_size_picks_parts_that_fit(
    store: FsspecStore, moto_s3: MotoS3, s3_root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3upload, "MAX_PARTS", 3)
    data = bytes(range(251)) * (PART // 251 * 4 + 17)  # over four 5 MiB parts
    sink = store.open_file("f.bin", size=len(data))
    for start in range(0, len(data), 3 * MiB):
        sink.write(data[start : start + 3 * MiB])
    sink.commit()
    assert store.read_bytes("f.bin") == data
    assert _uploads(moto_s3, s3_root) == []


def test_too_many_parts_without_a_size_is_a_typed_error(
    store: FsspecStore, moto_s3: MotoS3, s3_root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3upload, "MAX_PARTS", 2)
    sink = store.open_file("f.bin")
    with pytest.raises(StorageFullError, match="parts"):
        sink.write(b"z" * (3 * PART))
    sink.discard()
    assert _uploads(moto_s3, s3_root) == []


def test_writer_declares_sizes_so_large_tensors_fit(
    s3_root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(FsspecStore, "block_size", PART)
    monkeypatch.setattr(s3upload, "MAX_PARTS", 2)
    state = {"w": torch.arange(3 * PART // 4, dtype=torch.float32)}  # 15 MiB: three parts
    options = s3_root.storage_options
    with checkpointd.CheckpointWriter(s3_root.url, storage_options=options) as writer:
        writer.save(1, state).result(timeout=60)
    loaded = checkpointd.load(s3_root.url, storage_options=options, verify=True)
    assert torch.equal(loaded.state["w"], state["w"])
