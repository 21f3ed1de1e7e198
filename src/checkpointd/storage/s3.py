"""S3Store: what a root on S3 (or an S3-compatible server) does beyond generic fsspec.

The bucket must exist (checked on construction; never created). Files go up
as parallel multipart uploads (s3upload.py), invisible until completed;
discard aborts them, and ``pending_uploads`` finds those a dead writer left.
The manifest is created with ``If-None-Match: *`` where the server honours it
(probed once, on first publish: ``exclusive_create``); elsewhere publish is the
guarded one and warns once. Translates OSError, fsspec's, botocore's and
aiohttp's errors. Blocking; any thread.
"""

from __future__ import annotations

import contextlib
import errno
import threading
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import botocore.exceptions
import fsspec.asyn

from checkpointd import tunables
from checkpointd.errors import (
    StorageError,
    StorageNotFoundError,
    StoragePermissionError,
)
from checkpointd.storage.base import Capabilities, FileSink, PendingUpload
from checkpointd.storage.conditional import ConditionalCreateStore
from checkpointd.storage.fsspec import FsspecStore, TranslatingSink, timestamp
from checkpointd.storage.s3client import SyncS3
from checkpointd.storage.s3read import RangedReader, ThreadedRangedReader
from checkpointd.storage.s3upload import ParallelUploadSink, choose_part_size, s3fs_submit

__all__ = ["S3Store", "refused_as_existing"]


class S3Store(ConditionalCreateStore):
    """A root ``s3://bucket/prefix`` through s3fs (see the module doc)."""

    backend_errors = (
        *FsspecStore.backend_errors,
        botocore.exceptions.BotoCoreError,
        botocore.exceptions.ClientError,
        aiohttp.ClientError,
    )

    @property
    def parallel_parts(self) -> int:
        """Parts of one file uploaded at once (also the parts held in memory per file):
        ``tunables.S3_PARALLEL_PARTS``, read when asked."""
        return tunables.S3_PARALLEL_PARTS

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        options = dict(storage_options or {})
        own_session = "session" not in options
        if own_session and "profile" not in options:
            # botocore's service model is parsed once per session: a store per restore
            # would otherwise pay that (0.2-0.8 s) before its first request.
            options["session"] = _shared_session()
        super().__init__(url, options)
        # Bulk transfers through a sync client where s3fs's settings map onto one
        # (s3client.py); a caller's own aiobotocore session stays s3fs's alone.
        threads = max(
            tunables.S3_READ_PARALLEL, self.parallel_parts * tunables.DEFAULT_MAX_CONCURRENCY
        )
        self._sync = SyncS3.build(self.fs, threads) if own_session else None
        self._ranged: RangedReader | ThreadedRangedReader
        if self._sync is None:
            part, limit = tunables.S3_READ_PART_BYTES, tunables.S3_READ_PARALLEL
            self._ranged = RangedReader(self.fs, part, limit)
        else:
            self._ranged = ThreadedRangedReader(
                self._sync, self.fs, tunables.S3_READ_PART_BYTES, tunables.S3_READ_PARALLEL
            )
        self._start_probing()
        with self._translating("open", url):
            self._check_bucket()

    @property
    def capabilities(self) -> Capabilities:
        """Times and multipart uploads; exclusive create None until probed."""
        return Capabilities(
            exclusive_create=self._exclusive, modification_times=True, pending_uploads=True
        )

    def _check_bucket(self) -> None:
        """Raise unless the root's bucket exists and is reachable; never creates it."""
        bucket = self.root.partition("/")[0]
        if not bucket:
            raise StorageError(errno.EINVAL, f"{self.url}: no bucket in the URL")
        try:
            self.fs.call_s3("head_bucket", Bucket=bucket)
        except FileNotFoundError:
            raise StorageNotFoundError(
                errno.ENOENT,
                f"{self.url}: bucket {bucket!r} does not exist (checkpointd never creates buckets)",
            ) from None
        except PermissionError as exc:
            raise StoragePermissionError(
                errno.EACCES, f"{self.url}: access to bucket {bucket!r} denied: {exc}"
            ) from None

    def _put(self, target: str, data: bytes, exclusive: bool) -> None:
        """One PUT, with ``If-None-Match: *`` if ``exclusive``; raw s3fs errors."""
        self.fs.pipe_file(target, data, mode="create" if exclusive else "overwrite")

    def _refused_as_existing(self, exc: BaseException) -> bool:
        return refused_as_existing(exc)

    def make_dir(self, path: str) -> None:
        """Folders are implicit on S3, and s3fs's makedirs would create a missing bucket."""
        self._abs(path)

    def _info(self, target: str) -> dict[str, Any]:
        """The object's own metadata: s3fs would answer from the last listing otherwise."""
        return dict(self.fs.info(target, refresh=True))

    def read_into(self, path: str, buffer: memoryview, offset: int = 0) -> None:
        """Concurrent ranged GETs (s3read.py); a short object raises."""
        size = self.read_into_sized(path, buffer, offset)
        if offset + len(buffer) > size:
            raise StorageError(errno.EIO, f"read {self._abs(path)}: file is shorter than expected")

    def read_into_sized(self, path: str, buffer: memoryview, offset: int = 0) -> int:
        """As ``read_into``, the size taken from the GETs' Content-Range: no HEAD."""
        target = self._abs(path)
        with self._translating("read", target):
            if isinstance(self._ranged, ThreadedRangedReader):
                return self._ranged.read_ranges(target, buffer, offset)
            size: int = fsspec.asyn.sync(
                self.fs.loop, self._ranged.read_ranges, target, buffer, offset
            )
            return size

    def open_file(self, path: str, size: int | None = None) -> FileSink:
        target = self._abs(path)
        part_size = choose_part_size(size, self.block_size)
        bucket, key, _ = self.fs.split_path(target)
        sink = ParallelUploadSink(
            s3fs_submit(self.fs) if self._sync is None else self._sync.submit,
            bucket,
            key,
            part_size=part_size,
            max_parallel=self.parallel_parts,
            send_buffers=self._sync is not None,
            checksums=self._sync is not None and self._sync.checksums,
        )
        return TranslatingSink(self._translating, sink, target)

    def close(self) -> None:
        """Close the sync client's connections (its workers finish first)."""
        if self._sync is not None:
            self._sync.close()

    def pending_uploads(self) -> list[PendingUpload]:
        """Incomplete multipart uploads whose key lies under the root."""
        with self._translating("list uploads", self.url):
            return self._list_uploads()

    def _list_uploads(self) -> list[PendingUpload]:
        bucket, _, prefix = self.root.partition("/")
        prefix = f"{prefix}/" if prefix else ""
        found: list[PendingUpload] = []
        markers: dict[str, str] = {}
        while True:
            page = self.fs.call_s3(
                "list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers
            )
            for upload in page.get("Uploads", []) or []:
                key, upload_id = upload["Key"], upload["UploadId"]
                parts = self.fs.call_s3("list_parts", Bucket=bucket, Key=key, UploadId=upload_id)
                times = [timestamp(upload.get("Initiated"))]
                times += [timestamp(part.get("LastModified")) for part in parts.get("Parts", [])]
                last = max((t for t in times if t is not None), default=time.time())
                found.append(PendingUpload(key[len(prefix) :], upload_id, last))
            if not page.get("IsTruncated"):
                return found
            markers = {
                "KeyMarker": page.get("NextKeyMarker") or "",
                "UploadIdMarker": page.get("NextUploadIdMarker") or "",
            }
            if not markers["KeyMarker"]:
                raise StorageError(errno.EIO, "a truncated upload listing without a next marker")

    def abort_upload(self, upload: PendingUpload) -> None:
        bucket, _, prefix = self.root.partition("/")
        key = f"{prefix}/{upload.path}" if prefix else upload.path
        with contextlib.suppress(StorageNotFoundError), self._translating("abort upload", key):
            self.fs.call_s3(
                "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload.upload_id
            )


_session_lock = threading.Lock()
_session: Any = None


def _shared_session() -> Any:
    """One aiobotocore session for the process's S3 stores (credentials stay per client)."""
    global _session
    with _session_lock:
        if _session is None:
            from aiobotocore.session import AioSession

            _session = AioSession()
        return _session


def refused_as_existing(exc: BaseException) -> bool:
    """True if ``exc`` is a conditional PUT refused because the key exists (412).

    s3fs maps only a 412 naming the ``If-None-Match`` condition to FileExistsError;
    some servers omit the condition, which s3fs reports as a plain OSError."""
    if isinstance(exc, FileExistsError):
        return True
    response = getattr(exc.__cause__, "response", None)
    if not isinstance(response, dict):
        return False
    code = response.get("Error", {}).get("Code")
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return bool(code == "PreconditionFailed" or status == 412)
