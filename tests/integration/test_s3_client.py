"""An S3 store's bulk transfers (upload parts, ranged GETs) go through a sync botocore
client built from the s3fs storage options, seen on the wire through a loopback proxy in
front of moto: the store's credentials sign them (none with anon), config_kwargs reach
them; options with no sync equivalent keep s3fs's path."""

from __future__ import annotations

import collections
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import pytest
import s3fs
import torch
from aiobotocore.session import AioSession

import checkpointd
from checkpointd.errors import StoragePermissionError
from checkpointd.storage import FsspecStore, open_store
from checkpointd.storage.s3client import SyncS3
from tests.support.s3 import MotoS3
from tests.support.tcp_proxy import Action, FaultProxy

PART = 5 * 2**20


class _Wire:
    """The header block of every request through the proxy, and the calls each client sent."""

    def __init__(self, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch) -> None:
        self.heads: set[bytes] = set()
        self.sync: collections.Counter[str] = collections.Counter()
        self.s3fs: collections.Counter[str] = collections.Counter()
        proxy.fault = self._see
        original_once, original_call = SyncS3.once, s3fs.S3FileSystem._call_s3  # noqa: SLF001

        def once(client: SyncS3, method: str, **kwargs: Any) -> Any:
            self.sync[method] += 1
            return original_once(client, method, **kwargs)

        async def call(fs: Any, method: str, *args: Any, **kwargs: Any) -> Any:
            self.s3fs[method] += 1
            return await original_call(fs, method, *args, **kwargs)

        monkeypatch.setattr(SyncS3, "once", once)
        monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", call)

    def _see(self, _n: int, seen: bytes) -> Action:
        head, ended, _ = seen.partition(b"\r\n\r\n")
        if ended:
            self.heads.add(head.lower())
        return "pass"

    def requests(self, start: bytes) -> list[bytes]:
        """Header blocks whose request line starts with ``start`` (lower case)."""
        return [h for h in self.heads if h.startswith(start)]


@pytest.fixture
def proxy(moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    monkeypatch.setattr(FsspecStore, "block_size", PART)
    url = urlparse(moto_s3.endpoint)
    assert url.hostname is not None
    assert url.port is not None
    fault_proxy = FaultProxy((url.hostname, url.port))
    try:
        yield fault_proxy
    finally:
        fault_proxy.stop()


def _state() -> dict[str, Any]:
    return {"model": {"w": torch.arange(PART // 4 + 1000, dtype=torch.float32)}}


def _round_trip(moto_s3: MotoS3, options: dict[str, Any]) -> None:
    bucket = f"client-{uuid.uuid4().hex[:10]}"
    moto_s3.create_bucket(bucket)
    root = f"s3://{bucket}/run"
    with checkpointd.CheckpointWriter(root, storage_options=options) as writer:
        writer.save(1, _state()).result()
    loaded = checkpointd.load(root, storage_options=options)
    assert torch.equal(loaded.state["model"]["w"], _state()["model"]["w"])


def test_parts_and_ranges_go_through_the_sync_client_signed_by_the_store_keys(
    moto_s3: MotoS3, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    wire = _Wire(proxy, monkeypatch)
    _round_trip(moto_s3, moto_s3.storage_options(proxy.endpoint))
    assert wire.sync["upload_part"] == 2  # the tensor file: two parts
    assert wire.sync["get_object"] >= 2
    for bulk in ("upload_part", "get_object", "create_multipart_upload"):
        assert wire.s3fs[bulk] == 0, bulk
    parts, ranges = wire.requests(b"put "), wire.requests(b"get ")
    parts = [h for h in parts if b"partnumber=" in h.split(b"\r\n")[0]]
    assert len(parts) == 2
    assert any(b"\r\nrange: bytes=" in h for h in ranges)
    for head in parts + ranges:
        assert b"authorization: aws4-hmac-sha256 credential=testing/" in head
    # botocore signs each part's bytes over plain http, as it does by default
    assert all(b"x-amz-content-sha256: unsigned-payload" not in h for h in parts)


def test_config_kwargs_reach_the_sync_client(
    moto_s3: MotoS3, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    wire = _Wire(proxy, monkeypatch)
    options = moto_s3.storage_options(proxy.endpoint)
    options["config_kwargs"] = {"s3": {"payload_signing_enabled": False}}
    _round_trip(moto_s3, options)
    parts = [h for h in wire.requests(b"put ") if b"partnumber=" in h.split(b"\r\n")[0]]
    assert len(parts) == 2
    assert all(b"x-amz-content-sha256: unsigned-payload" in h for h in parts)


def test_anon_reads_go_unsigned_and_a_refusal_is_a_permission_error(
    moto_s3: MotoS3, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = f"client-{uuid.uuid4().hex[:10]}"
    moto_s3.create_bucket(bucket)
    moto_s3.client().put_object(Bucket=bucket, Key="run/private.bin", Body=b"x" * 100)
    wire = _Wire(proxy, monkeypatch)
    options = moto_s3.storage_options(proxy.endpoint)
    options = {"anon": True, "client_kwargs": options["client_kwargs"], "skip_instance_cache": True}
    store = open_store(f"s3://{bucket}/run", options)
    try:
        with pytest.raises(StoragePermissionError):
            store.read_into_sized("private.bin", memoryview(bytearray(10)))
    finally:
        store.close()
    assert wire.sync["get_object"] == 1
    (get,) = wire.requests(b"get ")
    assert b"\r\nrange: bytes=0-9" in get
    assert b"\r\nauthorization:" not in get


def test_options_without_a_sync_equivalent_keep_s3fs(
    moto_s3: MotoS3, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    wire = _Wire(proxy, monkeypatch)
    options = moto_s3.storage_options(proxy.endpoint)
    options["session"] = AioSession()  # the caller's own session: only s3fs uses it
    _round_trip(moto_s3, options)
    assert not wire.sync
    assert wire.s3fs["upload_part"] == 2
    assert wire.s3fs["get_object"] >= 2
