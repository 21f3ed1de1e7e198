"""Storage backends, chosen by the URL protocol of a checkpoint root.

``open_store(root)`` opens a local path or ``file://`` URL as LocalStore,
``s3://`` as S3Store, ``gs://``/``gcs://`` as GCSStore, ``az://``/``abfs://`` as
AzureStore, and any other protocol through the registry: backends
registered with ``register_store`` in this process first, then those that
installed packages declare under the entry-point group ``checkpointd.stores``
(loaded only when their protocol is first asked for), and last the generic
FsspecStore for any protocol fsspec knows. A backend is one module: a Store
subclass (storage/base.py) and a registration. Backend modules load lazily,
so importing this package imports neither fsspec nor boto, gcsfs or adlfs.

``resolve_root(root)`` is what a root names from this process (a local path made
absolute): a root is resolved where the user gave it, before it is kept or sent to
another process (the checkpoint service has a working folder of its own).
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from checkpointd.errors import StorageError
from checkpointd.storage.base import (
    TEMP_MARKER,
    Capabilities,
    FileSink,
    PendingUpload,
    Store,
    check_relpath,
    translate_errors,
)
from checkpointd.storage.local import LocalStore

if TYPE_CHECKING:
    from checkpointd.storage.azure import AzureStore
    from checkpointd.storage.fsspec import FsspecStore
    from checkpointd.storage.gcs import GCSStore
    from checkpointd.storage.s3 import S3Store

__all__ = [
    "ENTRY_POINT_GROUP",
    "TEMP_MARKER",
    "AzureStore",
    "Capabilities",
    "FileSink",
    "FsspecStore",
    "GCSStore",
    "LocalStore",
    "PendingUpload",
    "S3Store",
    "Store",
    "StoreFactory",
    "check_relpath",
    "fixed_root",
    "open_store",
    "register_store",
    "resolve_root",
    "translate_errors",
]

StoreFactory = Callable[[str, Mapping[str, Any] | None], Store]
"""Makes a store from the root URL as the user gave it and its storage options."""

ENTRY_POINT_GROUP = "checkpointd.stores"
"""Entry points named by protocol whose object is a StoreFactory."""

_registry: dict[str, StoreFactory] = {}
_lock = threading.Lock()


def register_store(protocol: str, factory: StoreFactory) -> None:
    """Open roots ``{protocol}://...`` with ``factory`` from now on (replaces an earlier one).

    Any thread; usually at import time of the module that defines the backend."""
    if not protocol or "://" in protocol or protocol in ("file", ""):
        raise StorageError(errno.EINVAL, f"cannot register a store for protocol {protocol!r}")
    with _lock:
        _registry[protocol] = factory


def _local(url: str, storage_options: Mapping[str, Any] | None) -> Store:
    return LocalStore(url.removeprefix("file://"))


def _s3(url: str, storage_options: Mapping[str, Any] | None) -> Store:
    from checkpointd.storage.s3 import S3Store

    return S3Store(url, storage_options)


def _gcs(url: str, storage_options: Mapping[str, Any] | None) -> Store:
    from checkpointd.storage.gcs import GCSStore

    return GCSStore(url, storage_options)


def _azure(url: str, storage_options: Mapping[str, Any] | None) -> Store:
    from checkpointd.storage.azure import AzureStore

    return AzureStore(url, storage_options)


def _fsspec(url: str, storage_options: Mapping[str, Any] | None) -> Store:
    from checkpointd.storage.fsspec import FsspecStore

    return FsspecStore(url, storage_options)


_BUILT_IN: dict[str, StoreFactory] = {
    "file": _local,
    "s3": _s3,
    "s3a": _s3,
    "gs": _gcs,
    "gcs": _gcs,
    "az": _azure,
    "abfs": _azure,
}


def _factory(protocol: str) -> StoreFactory:
    """The factory for ``protocol``: registered, built in, an entry point, else fsspec."""
    with _lock:
        found = _registry.get(protocol)
    if found is not None:
        return found
    if protocol in _BUILT_IN:
        return _BUILT_IN[protocol]
    for point in entry_points(group=ENTRY_POINT_GROUP, name=protocol):
        loaded: StoreFactory = point.load()
        with _lock:
            return _registry.setdefault(protocol, loaded)
    return _fsspec


def _local_part(root: str) -> str | None:
    """The local path a root names (a plain path, or a ``file://`` URL's), None for a URL."""
    protocol, sep, rest = root.partition("://")
    if not sep:
        return root
    return rest if protocol == "file" else None


def resolve_root(root: str | os.PathLike[str]) -> str:
    """What ``root`` names from this process, spelled so that it names the same from any
    other: a local path (or ``file://`` URL) with ``~`` expanded and made absolute against
    this process's working folder, symlinks kept (as LocalStore opens it); another URL
    without trailing slashes. The same root resolved twice is unchanged. Any thread."""
    text = os.fspath(root)
    local = _local_part(text)
    if local is None:
        protocol, _, rest = text.partition("://")
        return f"{protocol}://{rest.rstrip('/') or rest}"
    path = os.path.abspath(os.path.expanduser(local))
    return f"file://{path}" if text.startswith("file://") else path


def fixed_root(root: str) -> bool:
    """Whether ``root`` names the same place from every process: a URL, or an absolute
    local path (not relative, not ``~``). A process that serves others refuses the rest."""
    local = _local_part(root)
    return local is None or os.path.isabs(local)


def open_store(root: str, storage_options: Mapping[str, Any] | None = None) -> Store:
    """Open the store for a local path, a ``file://`` URL, or another URL by its protocol."""
    protocol, sep, _ = root.partition("://")
    if not sep:
        if storage_options:
            raise StorageError(errno.EINVAL, "storage_options are only for fsspec URLs")
        return LocalStore(root)
    return _factory(protocol)(root, storage_options)


def __getattr__(name: str) -> Any:
    """FsspecStore, S3Store, GCSStore and AzureStore, imported on first use (they import
    fsspec and their client libraries)."""
    if name == "FsspecStore":
        from checkpointd.storage.fsspec import FsspecStore

        return FsspecStore
    if name == "S3Store":
        from checkpointd.storage.s3 import S3Store

        return S3Store
    if name == "GCSStore":
        from checkpointd.storage.gcs import GCSStore

        return GCSStore
    if name == "AzureStore":
        from checkpointd.storage.azure import AzureStore

        return AzureStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
