"""Reads from S3 as concurrent ranged GETs: a read longer than ``part`` bytes is split
into ranges fetched at once, at most ``limit`` GETs in flight per store (a semaphore on
s3fs's event loop, shared by every thread reading through the store). Each response's
Content-Range names the object's size, so a read checks the size without a HEAD.

``read_ranges`` runs on s3fs's loop (its coroutines such as ``_call_s3`` are fsspec's
async API); call it through ``fsspec.asyn.sync``. Raises raw s3fs errors (the store
translates them).
"""

from __future__ import annotations

import asyncio
import errno
from typing import Any

from checkpointd.errors import StorageError
from checkpointd.storage.s3upload import call_s3

__all__ = ["RangedReader"]

_PIECE = 4 * 2**20
"""The most bytes taken from a reply's body at once."""


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
        ranges = [(a, min(a + self.part, len(buffer))) for a in range(0, len(buffer), self.part)]
        sizes = await asyncio.gather(
            *(self._get(bucket, key, buffer, offset, a, b) for a, b in ranges)
        )
        if len(set(sizes)) != 1:
            raise StorageError(
                errno.EIO, f"read {target}: the object changed size while it was being read"
            )
        return sizes[0]

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
            total = _total(response.get("ContentRange"))
            if total is None and offset + a == 0:
                total = response.get("ContentLength")  # a whole object sent as it is (200)
            body = response["Body"]
            try:
                if total is None:
                    raise StorageError(
                        errno.EIO, f"read s3://{bucket}/{key}: no Content-Range in reply"
                    )
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
            chunk = await body.read(min(b - at, _PIECE))  # what has arrived, at most that
            if not chunk:
                break
            n = min(len(chunk), b - at)
            buffer[at : at + n] = chunk[:n]
            at += n
        if at != b:
            raise StorageError(errno.EIO, f"read {where}: short reply ({at - a} of {b - a} bytes)")
