"""S3 faults over real HTTP: a loopback proxy between s3fs and moto's server.

Transient faults (a connection dropped mid-part, a 500, a slow network, a
manifest PUT whose reply is lost) are retried and the save succeeds, exactly
once. Permanent faults fail the save with a typed error, publish nothing, and
leave no incomplete multipart upload behind.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlparse

import pytest
import torch

import checkpointd
from checkpointd.errors import StorageError
from checkpointd.storage import FsspecStore, S3Store
from tests.faults.helpers import check_intact, same
from tests.support.s3 import MotoS3
from tests.support.tcp_proxy import Action, FaultProxy

PART = 5 * 2**20  # S3's smallest part: the tensor file below takes two parts


@pytest.fixture
def proxy(moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    monkeypatch.setattr(FsspecStore, "block_size", PART)
    url = urlparse(moto_s3.endpoint)
    assert url.hostname is not None
    assert url.port is not None
    fault_proxy = FaultProxy((url.hostname, url.port), delay_s=0.3)
    try:
        yield fault_proxy
    finally:
        fault_proxy.stop()


def _state(step: int) -> dict[str, Any]:
    return {"model": {"w": torch.full((PART // 4 + 1000,), float(step))}, "meta": {"s": step}}


def _options(moto_s3: MotoS3, proxy: FaultProxy, attempts: int = 3) -> dict[str, Any]:
    options = moto_s3.storage_options(proxy.endpoint)
    # Bounded retries with backoff (botocore's standard mode) so permanent faults end quickly.
    options["config_kwargs"] = {"retries": {"max_attempts": attempts, "mode": "standard"}}
    return options


def _root(moto_s3: MotoS3) -> tuple[str, str]:
    bucket = f"faults-{uuid.uuid4().hex[:10]}"
    moto_s3.create_bucket(bucket)
    return bucket, f"s3://{bucket}/run"


def _is_part(seen: bytes) -> bool:
    return seen.startswith(b"PUT ") and b"partNumber=" in seen.split(b"\r\n", 1)[0]


def _is_manifest_put(seen: bytes) -> bool:
    first = seen.split(b"\r\n", 1)[0]
    return first.startswith(b"PUT ") and b"manifest.json" in first


def _once(predicate: Callable[[bytes], bool], action: Action) -> Callable[[int, bytes], Action]:
    fired = [False]

    def fault(_n: int, seen: bytes) -> Action:
        if not fired[0] and predicate(seen):
            fired[0] = True
            return action
        return "pass"

    return fault


def _mid_part(seen: bytes) -> bool:
    return _is_part(seen) and len(seen) > 2 * 2**20


TRANSIENT: dict[str, tuple[Callable[[int, bytes], Action], str]] = {
    "drop-mid-part": (_once(_mid_part, "drop"), "drop"),
    "500-on-part": (_once(_is_part, "500"), "500"),
    "500-on-manifest": (_once(_is_manifest_put, "500"), "500"),
    "manifest-reply-lost": (_once(_is_manifest_put, "cut_reply"), "cut_reply"),
    # Every part request stalls before its body flows (each request's first chunk waits).
    "slow-network": (
        lambda _n, seen: "delay" if _is_part(seen) and len(seen) <= 65536 else "pass",
        "delay",
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(TRANSIENT))
def test_transient_fault_retried(moto_s3: MotoS3, proxy: FaultProxy, case: str) -> None:
    bucket, root = _root(moto_s3)
    options = _options(moto_s3, proxy)
    fault, counter = TRANSIENT[case]
    with checkpointd.CheckpointWriter(root, storage_options=options) as writer:
        writer.save(1, _state(1)).result()
        proxy.fault = fault
        writer.save(2, _state(2)).result()
    assert proxy.counts[counter] >= 1, "the fault never fired"
    proxy.fault = lambda _n, _seen: "pass"
    direct = moto_s3.storage_options()
    assert check_intact(root, {1: _state(1), 2: _state(2)}, storage_options=direct) == [1, 2]
    assert moto_s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


PERMANENT: dict[str, Callable[[int, bytes], Action]] = {
    "500-on-every-part": lambda _n, seen: "500" if _is_part(seen) else "pass",
    "drop-every-part": lambda _n, seen: "drop" if _mid_part(seen) else "pass",
    "500-on-every-manifest-put": lambda _n, seen: "500" if _is_manifest_put(seen) else "pass",
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "case",
    [
        "500-on-every-part",
        pytest.param("drop-every-part", marks=pytest.mark.slow),
        "500-on-every-manifest-put",
    ],
)
def test_permanent_fault_fails_cleanly(moto_s3: MotoS3, proxy: FaultProxy, case: str) -> None:
    bucket, root = _root(moto_s3)
    options = _options(moto_s3, proxy, attempts=2)
    with checkpointd.CheckpointWriter(root, storage_options=options) as writer:
        writer.save(1, _state(1)).result()
        proxy.fault = PERMANENT[case]
        writer.save(2, _state(2))
        with pytest.raises(StorageError):
            writer.wait()
        assert proxy.counts["500"] + proxy.counts["drop"] >= 2, "not retried before failing"
        proxy.fault = lambda _n, _seen: "pass"
        # Nothing published, no upload left open; the writer still works.
        direct = moto_s3.storage_options()
        assert [i.step for i in checkpointd.list_checkpoints(root, storage_options=direct)] == [1]
        assert moto_s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
        writer.save(3, _state(3)).result()
    loaded = checkpointd.load(root, storage_options=moto_s3.storage_options())
    assert loaded.info.step == 3
    assert same(loaded.state, _state(3))


@pytest.mark.timeout(60)
def test_exception_mid_multipart_upload_aborts(
    moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure raised between two parts of a multipart upload: the upload is aborted."""
    monkeypatch.setattr(FsspecStore, "block_size", PART)
    bucket, root = _root(moto_s3)
    options = moto_s3.storage_options()
    real_open = S3Store.open_file
    client = moto_s3.client()
    in_flight: list[Any] = []

    class Boom(Exception):
        pass

    def open_file(self: S3Store, path: str, size: int | None = None) -> Any:
        sink = real_open(self, path, size=size)
        if not path.endswith(".safetensors"):
            return sink
        real_write = sink.write
        written = [0]

        def write(data: Any) -> None:
            if written[0] >= PART:  # the first part is already uploaded
                in_flight.extend(client.list_multipart_uploads(Bucket=bucket).get("Uploads", []))
                raise Boom("injected")
            real_write(data)
            written[0] += memoryview(data).nbytes

        sink.write = write  # type: ignore[method-assign]
        return sink

    monkeypatch.setattr(S3Store, "open_file", open_file)
    with checkpointd.CheckpointWriter(root, storage_options=options, chunk_bytes=2**20) as writer:
        writer.save(2, _state(2))
        with pytest.raises(Boom):
            writer.wait()
    assert len(in_flight) == 1, "the failure did not come in the middle of a multipart upload"
    assert checkpointd.list_checkpoints(root, storage_options=options) == []
    assert moto_s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
