"""An S3 store's bulk transfers (upload parts, ranged GETs) go through a sync botocore
client built from the s3fs storage options, seen on the wire through a loopback proxy in
front of moto: the store's credentials sign them (none with anon), config_kwargs reach
them; options with no sync equivalent keep s3fs's path.

Each part carries its CRC32C in a signed header and goes as UNSIGNED-PAYLOAD. moto
checks neither checksums nor payload hashes (``test_moto_checks_no_checksum``), so a
front that checks them as S3 does (tests/support/checksum_front.py) stands in for S3:
it sees every body whole, and refuses one altered on the way."""

from __future__ import annotations

import collections
import hashlib
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import pytest
import s3fs
import torch
from aiobotocore.session import AioSession

import checkpointd
from checkpointd.errors import StorageError, StoragePermissionError
from checkpointd.storage import FsspecStore, open_store
from checkpointd.storage.s3client import SyncS3
from tests.support.checksum_front import ChecksumFront, Seen, crc32c_header
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


@pytest.fixture
def front(moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch) -> Iterator[ChecksumFront]:
    monkeypatch.setattr(FsspecStore, "block_size", PART)
    url = urlparse(moto_s3.endpoint)
    assert url.hostname is not None
    assert url.port is not None
    checking = ChecksumFront((url.hostname, url.port))
    try:
        yield checking
    finally:
        checking.stop()


def _state() -> dict[str, Any]:
    return {"model": {"w": torch.arange(PART // 4 + 1000, dtype=torch.float32)}}


def _round_trip(moto_s3: MotoS3, options: dict[str, Any]) -> str:
    bucket = f"client-{uuid.uuid4().hex[:10]}"
    moto_s3.create_bucket(bucket)
    root = f"s3://{bucket}/run"
    with checkpointd.CheckpointWriter(root, storage_options=options) as writer:
        writer.save(1, _state()).result()
    loaded = checkpointd.load(root, storage_options=options)
    assert torch.equal(loaded.state["model"]["w"], _state()["model"]["w"])
    return bucket


def _signed_headers(seen: Seen) -> list[str]:
    return seen.headers["authorization"].split("SignedHeaders=")[1].split(",")[0].split(";")


def _posts(front: ChecksumFront, query: str) -> list[Seen]:
    return [r for r in front.requests if r.line.startswith("POST ") and query in r.line]


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
    # a part's bytes are covered by its signed CRC32C, not by a SHA-256 of them
    assert all(b"x-amz-content-sha256: unsigned-payload" in h for h in parts)


def test_parts_carry_their_crc32c_in_a_signed_header_and_go_unsigned(
    moto_s3: MotoS3, front: ChecksumFront
) -> None:
    bucket = _round_trip(moto_s3, moto_s3.storage_options(front.endpoint))
    parts = front.parts()
    assert len(parts) == 2
    for part in parts:
        assert part.headers["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD"
        assert part.headers["x-amz-checksum-crc32c"] == crc32c_header(part.body)
        assert part.headers["x-amz-sdk-checksum-algorithm"] == "CRC32C"
        assert "x-amz-checksum-crc32c" in _signed_headers(part)
        assert "x-amz-checksum-crc32" not in part.headers  # no second checksum pass
        assert "expect" not in part.headers  # the short last part too: no extra round trip
    (create,) = _posts(front, "?uploads")
    assert create.headers["x-amz-checksum-algorithm"] == "CRC32C"
    (complete,) = _posts(front, "uploadId=")
    # completing stays signed over its bytes, and names each part's checksum
    assert complete.headers["x-amz-content-sha256"] == hashlib.sha256(complete.body).hexdigest()
    for part in parts:
        crc = part.headers["x-amz-checksum-crc32c"]
        assert f"<ChecksumCRC32C>{crc}</ChecksumCRC32C>".encode() in complete.body
    # no body goes both unsigned and unchecked (the one-PUT files included)
    bodies = [r for r in front.requests if r.body]
    assert len(bodies) > len(parts) + 1
    for seen in bodies:
        if seen.headers["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD":
            assert seen.headers["x-amz-checksum-crc32c"] == crc32c_header(seen.body)
        else:
            assert seen.headers["x-amz-content-sha256"] == hashlib.sha256(seen.body).hexdigest()
    assert front.refused == 0
    assert moto_s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


@pytest.mark.parametrize("sign", [True, False])
def test_explicit_payload_signing_wins(moto_s3: MotoS3, front: ChecksumFront, sign: bool) -> None:
    options = moto_s3.storage_options(front.endpoint)
    options["config_kwargs"] = {"s3": {"payload_signing_enabled": sign}}
    _round_trip(moto_s3, options)
    parts = front.parts()
    assert len(parts) == 2
    for part in parts:
        assert part.headers["x-amz-checksum-crc32c"] == crc32c_header(part.body)
        signed = hashlib.sha256(part.body).hexdigest() if sign else "UNSIGNED-PAYLOAD"
        assert part.headers["x-amz-content-sha256"] == signed


def test_checksums_when_required_only_sends_none_and_signs_the_parts(
    moto_s3: MotoS3, front: ChecksumFront
) -> None:
    """For stores that refuse checksum headers: botocore's own switch turns ours off."""
    options = moto_s3.storage_options(front.endpoint)
    options["config_kwargs"] = {"request_checksum_calculation": "when_required"}
    _round_trip(moto_s3, options)
    parts = front.parts()
    assert len(parts) == 2
    for part in parts:
        assert not [h for h in part.headers if h.startswith("x-amz-checksum")]
        assert part.headers["x-amz-content-sha256"] == hashlib.sha256(part.body).hexdigest()
    (create,) = _posts(front, "?uploads")
    assert "x-amz-checksum-algorithm" not in create.headers
    (complete,) = _posts(front, "uploadId=")
    assert b"Checksum" not in complete.body


def _flip_part(number: int, times: int) -> Any:
    """A tamper hook that flips one byte of part ``number`` the first ``times`` times."""
    left = [times]

    def tamper(line: str, body: bytes) -> bytes:
        if f"partNumber={number}" not in line or not left[0]:
            return body
        left[0] -= 1
        return body[:100] + bytes([body[100] ^ 0x01]) + body[101:]

    return tamper


def test_a_part_altered_on_the_way_is_refused_and_sent_again(
    moto_s3: MotoS3, front: ChecksumFront
) -> None:
    front.tamper = _flip_part(2, times=1)
    _round_trip(moto_s3, moto_s3.storage_options(front.endpoint))  # loads the same bytes
    assert front.refused == 1
    first, again = [p for p in front.parts() if "partNumber=2" in p.line]
    assert first.body == again.body  # sent again from the intact buffer


def test_a_part_always_altered_fails_the_save_and_leaves_nothing(
    moto_s3: MotoS3, front: ChecksumFront
) -> None:
    front.tamper = _flip_part(1, times=1000)
    bucket = f"client-{uuid.uuid4().hex[:10]}"
    moto_s3.create_bucket(bucket)
    root = f"s3://{bucket}/run"
    options = moto_s3.storage_options(front.endpoint)
    # checkpointd's own tries only: botocore's (5, with its backoff, under each of them)
    # added ~35 s to the same outcome
    options["config_kwargs"] = {"retries": {"max_attempts": 1}}
    with (
        checkpointd.CheckpointWriter(root, storage_options=options) as writer,
        pytest.raises(StorageError),
    ):
        writer.save(1, _state()).result()
    assert front.refused > 1  # tried again before giving up
    assert checkpointd.list_checkpoints(root, storage_options=options) == []
    assert moto_s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_moto_checks_no_checksum(moto_s3: MotoS3) -> None:
    """Why the front exists: moto stores a part whose CRC32C header is wrong. (If this
    starts failing, moto checks checksums and the tamper tests can go straight to it.)"""
    bucket = f"client-{uuid.uuid4().hex[:10]}"
    moto_s3.create_bucket(bucket)
    client = moto_s3.client()
    upload = client.create_multipart_upload(Bucket=bucket, Key="k", ChecksumAlgorithm="CRC32C")
    client.upload_part(
        Bucket=bucket,
        Key="k",
        UploadId=upload["UploadId"],
        PartNumber=1,
        Body=b"x" * 1000,
        ChecksumCRC32C=crc32c_header(b"y" * 1000),
    )
    parts = client.list_parts(Bucket=bucket, Key="k", UploadId=upload["UploadId"])["Parts"]
    assert [p["Size"] for p in parts] == [1000]


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
