"""GCSStore: a root on Google Cloud Storage (``gs://bucket/prefix``, ``gcs://...``) over gcsfs.

The bucket must exist (checked on construction; never created: gcsfs's
``makedirs`` would create a missing bucket, so folders here are implicit).
Component files go up as resumable uploads opened with ``autocommit=False``:
nothing is visible until the sink commits (the final chunk), and discard
cancels the session. The manifest is created with ``ifGenerationMatch=0``, an
atomic create-if-absent, where the server honours it: probed once, on first
publish (``exclusive_create``), because emulators may accept the parameter
and overwrite anyway; there publish is the guarded one and warns once
(StorageCapabilityWarning). Resumable sessions cannot be listed, and expire
on their own: no ``pending_uploads``.

Uses gcsfs's plain JSON-API file system (``gcsfs.core.GCSFileSystem``), not
the experimental zonal/HNS one, which probes every bucket over gRPC first.
``storage_options`` go to it (``project``, ``token``, ``endpoint_url``...).
Translates OSError and gcsfs's, google-auth's, aiohttp's and requests' errors.
Blocking; any thread.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator, Mapping
from typing import Any

import aiohttp
import gcsfs.core
import gcsfs.retry
import google.auth.exceptions
import requests.exceptions

from checkpointd.errors import (
    StorageError,
    StorageNotFoundError,
    StoragePermissionError,
)
from checkpointd.storage.base import Capabilities, translate_errors
from checkpointd.storage.conditional import ConditionalCreateStore
from checkpointd.storage.fsspec import FsspecStore

__all__ = ["PROTOCOLS", "GCSStore", "refused_as_existing"]

PROTOCOLS = ("gs", "gcs")


class GCSStore(ConditionalCreateStore):
    """A root ``gs://bucket/prefix`` through gcsfs (see the module doc)."""

    backend_errors = (
        *FsspecStore.backend_errors,
        gcsfs.retry.HttpError,
        gcsfs.retry.ChecksumError,
        google.auth.exceptions.GoogleAuthError,
        aiohttp.ClientError,
        requests.exceptions.RequestException,
    )
    probe_errors = (OSError, *backend_errors, ValueError)

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.url = url
        protocol, sep, rest = url.partition("://")
        if not sep or protocol not in PROTOCOLS:
            raise StorageError(errno.EINVAL, f"{url}: not a gs:// or gcs:// URL")
        with self._translating("open", url):
            self.fs: Any = gcsfs.core.GCSFileSystem(**dict(storage_options or {}))
        self.root: str = rest.strip("/")
        self._start_probing()
        with self._translating("open", url):
            self._check_bucket()

    @property
    def capabilities(self) -> Capabilities:
        """Object times; exclusive create None until probed."""
        return Capabilities(exclusive_create=self._exclusive, modification_times=True)

    def _translating(self, action: str, path: str) -> contextlib.AbstractContextManager[None]:
        return _translate_gcs(action, path, self.backend_errors)

    def _check_bucket(self) -> None:
        """Raise unless the root's bucket exists and its objects can be listed; never
        creates it. Lists (at most one object) rather than reading the bucket's own
        metadata, which roles limited to objects may not read."""
        bucket = self.root.partition("/")[0]
        if not bucket:
            raise StorageError(errno.EINVAL, f"{self.url}: no bucket in the URL")
        try:
            self.fs.call("GET", "b/{}/o", bucket, maxResults=1, json_out=True)
        except FileNotFoundError:
            raise StorageNotFoundError(
                errno.ENOENT,
                f"{self.url}: bucket {bucket!r} does not exist (checkpointd never creates buckets)",
            ) from None

    def _put(self, target: str, data: bytes, exclusive: bool) -> None:
        """One upload, with ``ifGenerationMatch=0`` if ``exclusive``; raw gcsfs errors."""
        self.fs.pipe_file(target, data, mode="create" if exclusive else "overwrite")

    def _refused_as_existing(self, exc: BaseException) -> bool:
        return refused_as_existing(exc)

    def make_dir(self, path: str) -> None:
        """Folders are implicit on GCS, and gcsfs's makedirs would create a missing bucket."""
        self._abs(path)


@contextlib.contextmanager
def _translate_gcs(
    action: str, path: str, backend_errors: tuple[type[BaseException], ...]
) -> Iterator[None]:
    """translate_errors, with gcsfs's 403 (a plain OSError "Forbidden: ...") and an
    HttpError carrying 401/403 mapped to StoragePermissionError."""
    with translate_errors(action, path, backend_errors):
        try:
            yield
        except PermissionError:
            raise
        except OSError as exc:
            if not str(exc).startswith("Forbidden"):
                raise
            raise StoragePermissionError(errno.EACCES, f"{action} {path}: {exc}") from exc
        except gcsfs.retry.HttpError as exc:
            if exc.code not in (401, 403, "401", "403"):
                raise
            raise StoragePermissionError(errno.EACCES, f"{action} {path}: {exc}") from exc


def refused_as_existing(exc: BaseException) -> bool:
    """True if ``exc`` is an upload refused by its precondition (HTTP 412).

    gcsfs maps a 412 to FileExistsError; an HttpError carrying 412 counts too."""
    if isinstance(exc, FileExistsError):
        return True
    return isinstance(exc, gcsfs.retry.HttpError) and exc.code in (412, "412")
