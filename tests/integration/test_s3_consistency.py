"""S3 checks that guard a deletion or a commit ask S3 itself, and buckets are never made.

s3fs answers ``info``/``exists`` from the listing it cached on the last ``ls``;
a manifest another client committed after that listing would look absent, and
gc would delete a committed checkpoint. A mistyped bucket is an error when the
store opens, never a bucket created on the fly.
"""

from __future__ import annotations

import pytest

from checkpointd.errors import StorageNotFoundError
from checkpointd.format.manifest import MANIFEST_NAME, step_dirname
from checkpointd.maintain.cleanup import find_leftovers, remove_leftovers
from checkpointd.storage import Store, open_store
from tests.conftest import Root
from tests.integration.test_cli import run
from tests.support.s3 import MotoS3


def _bucket(root: Root) -> str:
    return root.url.removeprefix("s3://").partition("/")[0]


def _keys(moto_s3: MotoS3, bucket: str) -> list[str]:
    page = moto_s3.client().list_objects_v2(Bucket=bucket)
    return sorted(item["Key"] for item in page.get("Contents", []))


def _buckets(moto_s3: MotoS3) -> set[str]:
    return {b["Name"] for b in moto_s3.client().list_buckets()["Buckets"]}


def _write(store: Store, path: str, data: bytes) -> None:
    sink = store.open_file(path)
    sink.write(data)
    sink.commit()


def test_gc_keeps_a_folder_committed_between_scan_and_removal(
    s3_root: Root, moto_s3: MotoS3
) -> None:
    store = open_store(s3_root.url, s3_root.storage_options)
    folder = step_dirname(7)
    _write(store, f"{folder}/model.safetensors", b"t" * 100)
    leftovers = find_leftovers(store, older_than=0)
    assert [(f.kind, f.path) for f in leftovers] == [("uncommitted", folder)]
    # A resumed job commits step 7 now, through its own client.
    key = f"run/{folder}/{MANIFEST_NAME}"
    moto_s3.client().put_object(Bucket=_bucket(s3_root), Key=key, Body=b"{}")
    remove_leftovers(store, leftovers)
    assert _keys(moto_s3, _bucket(s3_root)) == [key, f"run/{folder}/model.safetensors"]


def test_exists_after_listing_sees_a_key_put_by_another_client(
    s3_root: Root, moto_s3: MotoS3
) -> None:
    store = open_store(s3_root.url, s3_root.storage_options)
    _write(store, "d/a", b"1")
    assert store.list_dir("d") == ["a"]
    assert store.list_dir("") == ["d"]
    moto_s3.client().put_object(Bucket=_bucket(s3_root), Key="run/d/b", Body=b"22")
    assert store.exists("d/b")
    assert store.size("d/b") == 2
    assert store.modified("d/b") is not None
    moto_s3.client().delete_object(Bucket=_bucket(s3_root), Key="run/d/a")
    assert not store.exists("d/a")


def test_a_missing_bucket_is_an_error_when_the_store_opens(moto_s3: MotoS3) -> None:
    with pytest.raises(StorageNotFoundError, match="bucket 'no-such-bucket-xyz' does not exist"):
        open_store("s3://no-such-bucket-xyz/run", moto_s3.storage_options())
    assert "no-such-bucket-xyz" not in _buckets(moto_s3)


def test_make_dir_never_creates_a_bucket(s3_root: Root, moto_s3: MotoS3) -> None:
    store = open_store(s3_root.url, s3_root.storage_options)
    moto_s3.client().delete_bucket(Bucket=_bucket(s3_root))
    store.make_dir("000000000001")
    assert _bucket(s3_root) not in _buckets(moto_s3)


def test_cli_demo_refuses_a_missing_bucket(moto_s3: MotoS3) -> None:
    root = Root("s3://demo-typo-bucket/demo", moto_s3.storage_options(), "s3")
    done = run(root, "demo", root.url, "--steps", "2", "--save-every", "1", check=None)
    assert done.returncode != 0
    assert "bucket 'demo-typo-bucket' does not exist" in done.stderr
    assert "demo-typo-bucket" not in _buckets(moto_s3)
