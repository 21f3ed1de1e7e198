"""Parallel multipart upload of one file to S3, invisible until it is committed.

s3fs's own writer uploads a file's parts one after another; one stream to S3
(or to an S3-compatible server) is far slower than several. This sink cuts the
bytes it is given into parts and uploads up to ``max_parallel`` of them at once
on s3fs's event loop, holding at most that many parts in memory. ``commit``
completes the multipart upload (a file smaller than one part goes up as one
PUT); ``discard`` aborts it, so a failed save never leaves an object behind.

Implements storage.FileSink; one thread at a time calls write/commit/discard.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import threading
from typing import Any

from checkpointd.errors import StorageFullError
from checkpointd.format.checksum import BytesLike

__all__ = ["ParallelUploadSink", "choose_part_size"]

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


class ParallelUploadSink:
    """Uploads ``target`` on the s3fs file system ``fs`` as parts of ``part_size`` bytes."""

    def __init__(self, fs: Any, target: str, *, part_size: int, max_parallel: int) -> None:
        """``part_size`` from choose_part_size: the file must fit in MAX_PARTS of it."""
        if not MIN_PART_BYTES <= part_size <= MAX_PART_BYTES:
            raise ValueError(f"S3 parts must hold {MIN_PART_BYTES} to {MAX_PART_BYTES} bytes")
        self._fs = fs
        self._bucket, self._key, _ = fs.split_path(target)
        self._part_size = part_size
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[concurrent.futures.Future[dict[str, Any]]] = []
        self._slots = threading.BoundedSemaphore(max_parallel)

    def _call(self, method: str, **kwargs: Any) -> concurrent.futures.Future[dict[str, Any]]:
        """Run one S3 call on s3fs's event loop; s3fs retries transient errors itself."""
        coroutine = call_s3(self._fs, method, Bucket=self._bucket, Key=self._key, **kwargs)
        return asyncio.run_coroutine_threadsafe(coroutine, self._fs.loop)

    def write(self, data: BytesLike) -> None:
        """Buffer ``data``; each full part starts uploading (blocks while max_parallel are in flight)."""
        view = memoryview(data).cast("B")
        while view:
            take = min(len(view), self._part_size - len(self._buffer))
            self._buffer += view[:take]
            view = view[take:]
            if len(self._buffer) == self._part_size:
                self._send_part()

    def _send_part(self) -> None:
        if len(self._parts) >= MAX_PARTS:
            raise StorageFullError(
                errno.EFBIG,
                f"file needs more than {MAX_PARTS} parts of {self._part_size} bytes "
                "(open it with its size so the parts are chosen to fit)",
            )
        if self._upload_id is None:
            self._upload_id = str(self._call("create_multipart_upload").result()["UploadId"])
        for done in self._parts:
            if done.done() and done.exception() is not None:
                done.result()  # fail fast: a part already failed for good
        self._slots.acquire()
        body, self._buffer = bytes(self._buffer), bytearray()
        number = len(self._parts) + 1
        future = self._call("upload_part", UploadId=self._upload_id, PartNumber=number, Body=body)
        future.add_done_callback(lambda _: self._slots.release())
        self._parts.append(future)

    def commit(self) -> None:
        """Upload what is left, wait for every part, then complete: the object appears whole."""
        if self._upload_id is None:
            self._call("put_object", Body=bytes(self._buffer)).result()
            self._buffer = bytearray()
            return
        if self._buffer:
            self._send_part()
        parts = [
            {"PartNumber": number, "ETag": future.result()["ETag"]}
            for number, future in enumerate(self._parts, start=1)
        ]
        self._call(
            "complete_multipart_upload",
            UploadId=self._upload_id,
            MultipartUpload={"Parts": parts},
        ).result()
        self._upload_id = None
        self._parts = []

    def discard(self) -> None:
        """Abort the upload after its in-flight parts settle; nothing becomes visible."""
        self._buffer = bytearray()
        for future in self._parts:
            with contextlib.suppress(Exception):
                future.result()
        self._parts = []
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            with contextlib.suppress(Exception):
                self._call("abort_multipart_upload", UploadId=upload_id).result()
