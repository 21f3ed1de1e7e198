"""What FsspecStore does differently on S3: the bucket check, the exclusive-create
probe (used for every fsspec store), and listing incomplete multipart uploads.

The functions raise s3fs's (translated) errors raw; FsspecStore calls them
inside storage.translate_errors. Blocking; any thread.
"""

from __future__ import annotations

import contextlib
import errno
import secrets
import time
from collections.abc import Callable
from typing import Any

from checkpointd.errors import StorageError, StorageNotFoundError, StoragePermissionError

__all__ = [
    "check_bucket",
    "list_uploads",
    "probe_exclusive_create",
    "refused_as_existing",
    "timestamp",
]

PROBE_PREFIX = ".checkpointd-probe-"


def check_bucket(fs: Any, root: str, url: str) -> None:
    """Raise unless the bucket of ``root`` exists and is reachable; never creates it."""
    bucket = root.partition("/")[0]
    if not bucket:
        raise StorageError(errno.EINVAL, f"{url}: no bucket in the URL")
    try:
        fs.call_s3("head_bucket", Bucket=bucket)
    except FileNotFoundError:
        raise StorageNotFoundError(
            errno.ENOENT,
            f"{url}: bucket {bucket!r} does not exist (checkpointd never creates buckets)",
        ) from None
    except PermissionError as exc:
        raise StoragePermissionError(
            errno.EACCES, f"{url}: access to bucket {bucket!r} denied: {exc}"
        ) from None


def probe_exclusive_create(
    put: Callable[[str, bytes, bool], None], remove: Callable[[str], None], folder: str
) -> bool:
    """True if an exclusive ``put`` (``If-None-Match: *``) refuses a key that exists.

    ``put(key, data, exclusive)`` creates a fresh probe key in ``folder``, then
    tries again exclusively: that second try must be refused. A server that
    rejects the header outright (while a plain PUT works) lacks it too. Errors
    of a plain PUT propagate. The probe key is removed (best effort).
    """
    key = f"{folder}/{PROBE_PREFIX}{secrets.token_hex(8)}"
    try:
        try:
            put(key, b"probe", True)
        except OSError:
            put(key, b"probe", False)
            return False
        try:
            put(key, b"probe again", True)
        except OSError as exc:
            if refused_as_existing(exc):
                return True
            raise
        return False
    finally:
        with contextlib.suppress(Exception):
            remove(key)


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


def list_uploads(fs: Any, root: str) -> list[tuple[str, str, float]]:
    """(path under ``root``, upload id, last activity) of each incomplete multipart upload."""
    bucket, _, prefix = root.partition("/")
    prefix = f"{prefix}/" if prefix else ""
    found: list[tuple[str, str, float]] = []
    markers: dict[str, str] = {}
    while True:
        page = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers)
        for upload in page.get("Uploads", []) or []:
            key, upload_id = upload["Key"], upload["UploadId"]
            parts = fs.call_s3("list_parts", Bucket=bucket, Key=key, UploadId=upload_id)
            times = [timestamp(upload.get("Initiated"))]
            times += [timestamp(part.get("LastModified")) for part in parts.get("Parts", [])]
            last = max((t for t in times if t is not None), default=time.time())
            found.append((key[len(prefix) :], upload_id, last))
        if not page.get("IsTruncated"):
            return found
        markers = {
            "KeyMarker": page.get("NextKeyMarker") or "",
            "UploadIdMarker": page.get("NextUploadIdMarker") or "",
        }
        if not markers["KeyMarker"]:
            raise StorageError(errno.EIO, "a truncated upload listing without a next marker")


def timestamp(value: Any) -> float | None:
    """Unix seconds from what fsspec/botocore report (datetime, ISO string or number)."""
    from datetime import datetime

    if isinstance(value, datetime):
        return value.timestamp()
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return datetime.fromisoformat(value).timestamp()
    return None
