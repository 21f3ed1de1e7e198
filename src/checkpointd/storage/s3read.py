"""Reads from S3 as concurrent ranged GETs: a read longer than ``part`` bytes is split
into ranges fetched at once, at most ``limit`` GETs in flight per store (a semaphore
shared by every thread reading through the store). Each response's Content-Range names
the object's size, so a read checks the size without a HEAD.

Two readers, one plan: ``ThreadedRangedReader`` sends each range from a worker thread
of a ``SyncS3`` client (s3client.py) and reads the reply straight into the buffer; it
blocks, any thread. ``RangedReader`` (where no sync client could be built) runs on
s3fs's loop: call ``read_ranges`` through ``fsspec.asyn.sync``. Both raise what s3fs
raises (OSError for a ClientError; the store translates them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import functools
import threading
from typing import Any

import botocore.exceptions

from checkpointd import tunables
from checkpointd.errors import StorageError
from checkpointd.storage.s3client import SyncS3
from checkpointd.storage.s3upload import call_s3

__all__ = ["RangedReader", "ThreadedRangedReader"]


def _status(exc: BaseException) -> tuple[str | None, int | None, str | None]:
    """(error code, HTTP status, Content-Range) of a botocore error behind ``exc``."""
    response = getattr(exc, "response", None) or getattr(exc.__cause__, "response", None)
    if not isinstance(response, dict):
        return None, None, None
    meta = response.get("ResponseMetadata", {})
    headers = meta.get("HTTPHeaders", {}) or {}
    return (
        response.get("Error", {}).get("Code"),
        meta.get("HTTPStatusCode"),
        headers.get("content-range"),
    )


def _total(content_range: str | None) -> int | None:
    """The object size in a Content-Range header ("bytes 0-9/1234", "bytes */1234")."""
    if not content_range or "/" not in content_range:
        return None
    tail = content_range.rpartition("/")[2].strip()
    return int(tail) if tail.isdigit() else None


def _plan(length: int, part: int) -> list[tuple[int, int]]:
    """The ranges [a, b) of a ``length``-byte read, ``part`` bytes each (the last shorter)."""
    return [(a, min(a + part, length)) for a in range(0, length, part)]


def _one_size(sizes: list[int], target: str) -> int:
    """The object's size, the same in every reply, or StorageError."""
    if len(set(sizes)) != 1:
        raise StorageError(
            errno.EIO, f"read {target}: the object changed size while it was being read"
        )
    return sizes[0]


def _reply_total(response: dict[str, Any], start: int, where: str) -> int:
    """The object's size a GET reply names (Content-Range; a whole object sent as it is,
    status 200, only for a range from byte 0), or StorageError."""
    total = _total(response.get("ContentRange"))
    if total is None and start == 0:
        total = response.get("ContentLength")
    if total is None:
        raise StorageError(errno.EIO, f"read {where}: no Content-Range in reply")
    return int(total)


class ThreadedRangedReader:
    """Concurrent ranged reads through a ``SyncS3`` client's workers (see the module doc)."""

    def __init__(self, s3: SyncS3, fs: Any, part: int, limit: int) -> None:
        """``fs``: the store's s3fs file system (it splits paths into bucket and key)."""
        self._s3 = s3
        self._fs = fs
        self.part = max(1, part)
        self.limit = max(1, limit)
        self._gate = threading.BoundedSemaphore(self.limit)

    def read_ranges(self, target: str, buffer: memoryview, offset: int) -> int:
        """Fill ``buffer`` from byte ``offset`` of object ``target`` if it is long enough;
        return the object's size (the caller compares it). Returns only once every range
        has settled, so no worker writes into ``buffer`` afterwards."""
        bucket, key, _ = self._fs.split_path(target)
        if not len(buffer):
            with self._gate:
                return int(self._s3.call("head_object", Bucket=bucket, Key=key)["ContentLength"])
        jobs = [
            self._s3.run(functools.partial(self._get, bucket, key, buffer, offset, a, b))
            for a, b in _plan(len(buffer), self.part)
        ]
        concurrent.futures.wait(jobs)
        return _one_size([job.result() for job in jobs], target)

    def _get(  # noqa: PLR0917 - one range of read_ranges
        self, bucket: str, key: str, buffer: memoryview, offset: int, a: int, b: int
    ) -> int:
        """GET bytes [offset + a, offset + b) into ``buffer[a:b]``, tried again whole after
        a transient error; the object's size. On a worker thread."""
        with self._gate:
            return int(self._s3.retried(lambda: self._get_once(bucket, key, buffer, offset, a, b)))

    def _get_once(  # noqa: PLR0917 - one attempt of _get
        self, bucket: str, key: str, buffer: memoryview, offset: int, a: int, b: int
    ) -> int:
        where = f"s3://{bucket}/{key}"
        try:
            response = self._s3.once(
                "get_object", Bucket=bucket, Key=key, Range=f"bytes={offset + a}-{offset + b - 1}"
            )
        except botocore.exceptions.ClientError as exc:
            code, status, content_range = _status(exc)
            if code != "InvalidRange" and status != 416:
                raise
            total = _total(content_range)
            if total is not None:
                return total
            return int(self._s3.once("head_object", Bucket=bucket, Key=key)["ContentLength"])
        body = response["Body"]
        try:
            total = _reply_total(response, offset + a, where)
            if total >= offset + b:
                at = a
                while at < b:
                    got = body.readinto(buffer[at : min(b, at + tunables.S3_SYNC_BODY_PIECE_BYTES)])
                    if not got:
                        break
                    at += got
                if at != b:
                    raise StorageError(
                        errno.EIO, f"read {where}: short reply ({at - a} of {b - a} bytes)"
                    )
        finally:
            body.close()  # after a whole reply its connection is already back in the pool
        return total


class RangedReader:
    """Concurrent ranged reads of one s3fs filesystem (see the module doc)."""

    def __init__(self, fs: Any, part: int, limit: int) -> None:
        self.fs = fs
        self.part = max(1, part)
        self.limit = max(1, limit)
        self._gate: asyncio.Semaphore | None = None

    async def read_ranges(self, target: str, buffer: memoryview, offset: int) -> int:
        """Fill ``buffer`` from byte ``offset`` of object ``target`` if it is long enough;
        return the object's size (the caller compares it). Runs on s3fs's loop."""
        if self._gate is None:
            self._gate = asyncio.Semaphore(self.limit)  # created on, and bound to, the loop
        bucket, key, _ = self.fs.split_path(target)
        if not len(buffer):
            return await self._head(bucket, key)
        sizes = await asyncio.gather(
            *(
                self._get(bucket, key, buffer, offset, a, b)
                for a, b in _plan(len(buffer), self.part)
            )
        )
        return _one_size(list(sizes), target)

    async def _head(self, bucket: str, key: str, *, gated: bool = True) -> int:
        """The object's size from a HEAD (an empty read, or a range past its end)."""
        assert self._gate is not None
        if gated:
            async with self._gate:
                return await self._head(bucket, key, gated=False)
        info = await call_s3(self.fs, "head_object", Bucket=bucket, Key=key)
        return int(info["ContentLength"])

    async def _get(  # noqa: PLR0917 - one range of read_ranges
        self, bucket: str, key: str, buffer: memoryview, offset: int, a: int, b: int
    ) -> int:
        """GET bytes [offset + a, offset + b) into ``buffer[a:b]``; the object's size."""
        assert self._gate is not None
        async with self._gate:
            try:
                response = await call_s3(
                    self.fs,
                    "get_object",
                    Bucket=bucket,
                    Key=key,
                    Range=f"bytes={offset + a}-{offset + b - 1}",
                )
            except OSError as exc:
                code, status, content_range = _status(exc)
                if code != "InvalidRange" and status != 416:
                    raise
                total = _total(content_range)
                return total if total is not None else await self._head(bucket, key, gated=False)
            body = response["Body"]
            try:
                total = _reply_total(response, offset + a, f"s3://{bucket}/{key}")
                if total >= offset + b:
                    await self._stream(body, buffer, a, b, f"s3://{bucket}/{key}")
            finally:
                body.close()
        return total

    @staticmethod
    async def _stream(body: Any, buffer: memoryview, a: int, b: int, where: str) -> None:
        """Copy the reply's bytes into ``buffer[a:b]`` as they arrive: no copy of the
        whole range is held (a range's bytes object would be one more per GET in flight)."""
        at = a
        while at < b:
            chunk = await body.read(
                min(b - at, tunables.S3_BODY_PIECE_BYTES)
            )  # what has arrived, at most that
            if not chunk:
                break
            n = min(len(chunk), b - at)
            buffer[at : at + n] = chunk[:n]
            at += n
        if at != b:
            raise StorageError(errno.EIO, f"read {where}: short reply ({at - a} of {b - a} bytes)")
