"""AzureStore: a root on Azure Blob Storage (``az://container/prefix``, ``abfs://...``) over adlfs.

The container must exist (checked on construction; never created: adlfs's
``makedirs`` would create a missing container, so folders here are implicit).
Component files go up as staged blocks and become visible only when the
block list is committed (the sink's commit); a discarded file leaves
uncommitted blocks only, which are invisible and which Azure drops on its own
(so there is nothing for ``pending_uploads`` to list). The manifest is uploaded
with ``If-None-Match: *`` (azure-storage-blob's ``upload_blob(overwrite=False)``),
an atomic create-if-absent, where the server honours it: probed once, on first
publish (``exclusive_create``); elsewhere publish is the guarded one and warns
once (StorageCapabilityWarning).

``storage_options`` go to ``adlfs.AzureBlobFileSystem`` (``account_name``,
``account_key``, ``connection_string``, ``credential``, ``sas_token``...).
Translates OSError, fsspec's and azure-core's errors (not found, denied, other).
Blocking; any thread.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator, Mapping
from typing import Any

import adlfs
import aiohttp
import azure.core.exceptions as azure_errors
import fsspec.core

from checkpointd.errors import (
    StorageError,
    StorageNotFoundError,
    StoragePermissionError,
)
from checkpointd.storage.base import Capabilities, translate_errors
from checkpointd.storage.conditional import ConditionalCreateStore
from checkpointd.storage.fsspec import FsspecStore, timestamp

__all__ = ["PROTOCOLS", "AzureStore", "refused_as_existing"]

PROTOCOLS = ("az", "abfs")


class AzureStore(ConditionalCreateStore):
    """A root ``az://container/prefix`` through adlfs (see the module doc)."""

    backend_errors = (
        *FsspecStore.backend_errors,
        azure_errors.AzureError,
        aiohttp.ClientError,
    )
    probe_errors = (OSError, *backend_errors)

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.url = url
        protocol, sep, _ = url.partition("://")
        if not sep or protocol not in PROTOCOLS:
            raise StorageError(errno.EINVAL, f"{url}: not an az:// or abfs:// URL")
        with self._translating("open", url):
            self.fs: Any = adlfs.AzureBlobFileSystem(**dict(storage_options or {}))
            self.root: str = str(fsspec.core.strip_protocol(url)).strip("/")  # adlfs's rule
        self._start_probing()
        with self._translating("open", url):
            self._check_container()

    @property
    def capabilities(self) -> Capabilities:
        """Blob times; exclusive create None until probed."""
        return Capabilities(exclusive_create=self._exclusive, modification_times=True)

    def _translating(self, action: str, path: str) -> contextlib.AbstractContextManager[None]:
        return _translate_azure(action, path, self.backend_errors)

    def _check_container(self) -> None:
        """Raise unless the root's container exists and is reachable; never creates it."""
        container = self.root.partition("/")[0]
        if not container:
            raise StorageError(errno.EINVAL, f"{self.url}: no container in the URL")
        try:
            found = self.fs.info(container, refresh=True)
        except FileNotFoundError:
            found = None
        if found is None or found.get("type") != "directory":
            raise StorageNotFoundError(
                errno.ENOENT,
                f"{self.url}: container {container!r} does not exist "
                "(checkpointd never creates containers)",
            )

    def _put(self, target: str, data: bytes, exclusive: bool) -> None:
        """One upload, with ``If-None-Match: *`` if ``exclusive``; raw adlfs errors."""
        self.fs.pipe_file(target, data, mode="create" if exclusive else "overwrite")

    def _refused_as_existing(self, exc: BaseException) -> bool:
        return refused_as_existing(exc)

    def _info(self, target: str) -> dict[str, Any]:
        """The blob's own properties: adlfs would answer from the last listing otherwise."""
        return dict(self.fs.info(target, refresh=True))

    def make_dir(self, path: str) -> None:
        """Folders are implicit prefixes, and adlfs's makedirs would create a missing container."""
        self._abs(path)

    def modified(self, path: str) -> float | None:
        target = self._abs(path)
        with self._translating("stat", target):
            info = self._info(target)
            if info.get("type") != "file":
                raise StorageNotFoundError(errno.ENOENT, f"stat {target}: not a file")
        return timestamp(info.get("last_modified"))


def refused_as_existing(exc: BaseException) -> bool:
    """True if ``exc`` is an upload refused because the blob exists (409/412).

    adlfs maps azure-storage-blob's ResourceExistsError to FileExistsError."""
    if isinstance(exc, FileExistsError | azure_errors.ResourceExistsError):
        return True
    return isinstance(exc, azure_errors.HttpResponseError) and exc.status_code == 412


@contextlib.contextmanager
def _translate_azure(
    action: str, path: str, backend_errors: tuple[type[BaseException], ...]
) -> Iterator[None]:
    """translate_errors, with azure-core's not-found and denied errors mapped to theirs."""
    with translate_errors(action, path, backend_errors):
        try:
            yield
        except azure_errors.ResourceNotFoundError as exc:
            raise StorageNotFoundError(errno.ENOENT, f"{action} {path}: {exc.reason}") from exc
        except azure_errors.ClientAuthenticationError as exc:
            raise StoragePermissionError(errno.EACCES, f"{action} {path}: {exc.reason}") from exc
        except azure_errors.HttpResponseError as exc:
            if exc.status_code != 403:
                raise
            raise StoragePermissionError(errno.EACCES, f"{action} {path}: {exc.reason}") from exc
