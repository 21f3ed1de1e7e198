"""Parallel multipart upload of one file to S3, invisible until it is committed.

s3fs's own writer uploads a file's parts one after another; one stream to S3
(or to an S3-compatible server) is far slower than several. This sink cuts the
bytes it is given into parts and uploads up to ``max_parallel`` of them at once
through ``submit`` (a sync client's workers, s3client.py, or s3fs's event loop),
holding at most that many parts in memory, plus the one being filled. ``commit``
completes the multipart upload (a file smaller than one part goes up as one
PUT); ``discard`` aborts it, so a failed save never leaves an object behind.

With ``checksums``, every part (and a one-PUT file) carries the CRC32C of its bytes,
taken from the caller's bytes as they are buffered, in ``x-amz-checksum-crc32c``; the
upload is created with that algorithm and completed with each part's checksum, so a
store that checks checksums (S3 does) refuses a part whose bytes changed on the way.

Implements storage.FileSink; one thread at a time calls write/commit/discard.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import errno
import threading
from collections.abc import Callable
from typing import Any

from checkpointd.errors import StorageFullError
from checkpointd.format.checksum import BytesLike, crc32c

__all__ = ["ParallelUploadSink", "Submit", "call_s3", "choose_part_size", "s3fs_submit"]

MIN_PART_BYTES = 5 * 2**20
MAX_PART_BYTES = 5 * 2**30
MAX_PARTS = 10_000
MAX_OBJECT_BYTES = 5 * 2**40
"""S3's limits: parts of 5 MiB to 5 GiB (the last may be smaller), 10,000 parts, 5 TiB."""


def choose_part_size(size: int | None, preferred: int) -> int:
    """The part size for a file of ``size`` bytes (None: unknown): ``preferred`` where
    MAX_PARTS of it hold the file, else the smallest whole MiB that does; always
    within S3's part limits. StorageFullError (EFBIG) if the file exceeds 5 TiB."""
    part = min(max(preferred, MIN_PART_BYTES), MAX_PART_BYTES)
    if size is None:
        return part
    if size > MAX_OBJECT_BYTES:
        raise StorageFullError(
            errno.EFBIG, f"a {size}-byte file exceeds S3's object size limit of 5 TiB"
        )
    needed = -(-size // MAX_PARTS)
    if needed > part:
        part = min(-(-needed // 2**20) * 2**20, MAX_PART_BYTES)
    return part


def call_s3(fs: Any, method: str, **kwargs: Any) -> Any:
    """The coroutine of one S3 API call through s3fs, with s3fs's retries of transient
    errors and its credential refresh (which a bare aiobotocore client lacks). Await it
    on s3fs's event loop."""
    return fs._call_s3(method, **kwargs)  # noqa: SLF001 - s3fs has no public per-call API


Submit = Callable[..., "concurrent.futures.Future[dict[str, Any]]"]
"""``submit(method, **kwargs)``: start one S3 API call (retried as s3fs retries), its future."""


def s3fs_submit(fs: Any) -> Submit:
    """Calls through s3fs on its event loop (``call_s3``), from any thread."""

    def submit(method: str, **kwargs: Any) -> concurrent.futures.Future[dict[str, Any]]:
        return asyncio.run_coroutine_threadsafe(call_s3(fs, method, **kwargs), fs.loop)

    return submit


class ParallelUploadSink:
    """Uploads object ``key`` of ``bucket`` as parts of ``part_size`` bytes."""

    def __init__(
        self,
        submit: Submit,
        bucket: str,
        key: str,
        *,
        part_size: int,
        max_parallel: int,
        send_buffers: bool = False,
        checksums: bool = False,
    ) -> None:
        """``part_size`` from choose_part_size: the file must fit in MAX_PARTS of it.
        ``send_buffers``: a part goes as its buffer, a full one reused once sent (one copy
        of each part); else as ``bytes`` of it (two copies: aiobotocore over aiohttp left
        connections unclosed with a bytearray body). ``checksums``: each part's CRC32C
        goes with it (the module doc)."""
        if not MIN_PART_BYTES <= part_size <= MAX_PART_BYTES:
            raise ValueError(f"S3 parts must hold {MIN_PART_BYTES} to {MAX_PART_BYTES} bytes")
        self._submit = submit
        self._bucket, self._key = bucket, key
        self._part_size = part_size
        self._send_buffers = send_buffers
        self._checksums = checksums
        self._crc = 0  # of the buffered bytes (with checksums)
        self._free: list[bytearray] = []  # sent buffers, appended from done callbacks
        self._buffer = bytearray()  # grows to a part; its bytes past _fill are stale
        self._fill = 0
        self._upload_id: str | None = None
        self._parts: list[concurrent.futures.Future[dict[str, Any]]] = []
        self._part_crcs: list[str] = []  # base64, big-endian, as S3 writes a CRC32C
        self._slots = threading.BoundedSemaphore(max_parallel)

    def _call(self, method: str, **kwargs: Any) -> concurrent.futures.Future[dict[str, Any]]:
        """Start one S3 call on this object; its future."""
        return self._submit(method, Bucket=self._bucket, Key=self._key, **kwargs)

    def write(self, data: BytesLike) -> None:
        """Buffer ``data``; each full part starts uploading (blocks while max_parallel are in flight)."""
        view = memoryview(data).cast("B")
        while view:
            take = min(len(view), self._part_size - self._fill)
            if self._checksums:
                self._crc = crc32c(view[:take], self._crc)
            self._buffer[self._fill : self._fill + take] = view[:take]  # grows it if short
            self._fill += take
            view = view[take:]
            if self._fill == self._part_size:
                self._send_part()

    def _take(self) -> tuple[bytes | bytearray, dict[str, Any]]:
        """The buffered bytes as a body, and the checksum arguments that go with them;
        the buffer is empty after. With ``send_buffers`` the buffer itself (cut to its
        bytes: botocore would send ``bytes`` through a BytesIO, behind an
        ``Expect: 100-continue`` round trip), and a fresh or sent one takes its place."""
        body: bytes | bytearray
        if self._send_buffers:
            body = self._buffer
            del body[self._fill :]
            self._buffer = self._free.pop() if self._free else bytearray()
        else:
            body = bytes(memoryview(self._buffer)[: self._fill])
        self._fill = 0
        if not self._checksums:
            return body, {}
        value = base64.b64encode(self._crc.to_bytes(4, "big")).decode("ascii")
        self._crc = 0
        return body, {"ChecksumAlgorithm": "CRC32C", "ChecksumCRC32C": value}

    def _send_part(self) -> None:
        if len(self._parts) >= MAX_PARTS:
            raise StorageFullError(
                errno.EFBIG,
                f"file needs more than {MAX_PARTS} parts of {self._part_size} bytes "
                "(open it with its size so the parts are chosen to fit)",
            )
        if self._upload_id is None:
            algorithm = {"ChecksumAlgorithm": "CRC32C"} if self._checksums else {}
            created = self._call("create_multipart_upload", **algorithm).result()
            self._upload_id = str(created["UploadId"])
        for done in self._parts:
            if done.done() and done.exception() is not None:
                done.result()  # fail fast: a part already failed for good
        self._slots.acquire()
        whole = self._fill == self._part_size
        body, checksum = self._take()
        number = len(self._parts) + 1
        future = self._call(
            "upload_part", UploadId=self._upload_id, PartNumber=number, Body=body, **checksum
        )
        self._part_crcs.append(checksum.get("ChecksumCRC32C", ""))

        def sent(_: object, body: bytes | bytearray = body) -> None:
            if whole and isinstance(body, bytearray) and len(self._free) < 2:
                self._free.append(body)  # sent: botocore holds it no more
            self._slots.release()

        future.add_done_callback(sent)
        self._parts.append(future)

    def commit(self) -> None:
        """Upload what is left, wait for every part, then complete: the object appears whole."""
        if self._upload_id is None:
            body, checksum = self._take()
            self._call("put_object", Body=body, **checksum).result()
            return
        if self._fill:
            self._send_part()
        parts = []
        for number, (future, crc) in enumerate(
            zip(self._parts, self._part_crcs, strict=True), start=1
        ):
            part = {"PartNumber": number, "ETag": future.result()["ETag"]}
            parts.append({**part, "ChecksumCRC32C": crc} if crc else part)
        self._call(
            "complete_multipart_upload",
            UploadId=self._upload_id,
            MultipartUpload={"Parts": parts},
        ).result()
        self._upload_id = None
        self._parts, self._part_crcs = [], []
        self._free = []

    def discard(self) -> None:
        """Abort the upload after its in-flight parts settle; nothing becomes visible."""
        self._fill = self._crc = 0
        for future in self._parts:
            with contextlib.suppress(Exception):
                future.result()
        self._parts, self._part_crcs = [], []
        self._free = []
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            with contextlib.suppress(Exception):
                self._call("abort_multipart_upload", UploadId=upload_id).result()
