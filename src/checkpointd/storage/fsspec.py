"""FsspecStore: a root on any fsspec file system (memory://, gcs://, az://, ...).

Treated as an object store: files go straight to their final keys and become
visible when the sink commits; discard removes them. fsspec's generic
``pipe_file(mode="create")`` is an exists-then-write, not an atomic
create-if-absent, so this store declares no exclusive create: its publish is
the base class's guarded one (checked before, read back after, warned once).
Every existence, size and time check asks the object itself, never a cached
listing: those checks guard deletions and commits. Translates OSError and
fsspec's own errors. Blocking; any thread. S3 specifics live in s3.py.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import fsspec
from fsspec.exceptions import BlocksizeMismatchError
from fsspec.spec import AbstractFileSystem

from checkpointd import tunables
from checkpointd.errors import StorageError, StorageNotFoundError
from checkpointd.format.checksum import BytesLike
from checkpointd.storage.base import Capabilities, FileSink, Store, check_relpath

__all__ = ["FsspecStore", "TranslatingSink", "timestamp"]

Translate = Callable[[str, str], contextlib.AbstractContextManager[None]]
"""``(action, path)`` -> a context in which backend errors leave as StorageError."""


class FsspecStore(Store):
    """A root on an fsspec file system, treated as an object store (see the module doc)."""

    backend_errors: ClassVar[tuple[type[BaseException], ...]] = (BlocksizeMismatchError,)

    @property
    def block_size(self) -> int:
        """Bytes per upload part (S3: at least 5 MiB; 10,000 parts make the largest file
        160 GiB): ``tunables.S3_PART_BYTES``, read when asked."""
        return tunables.S3_PART_BYTES

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.url = url
        with self._translating("open", url):
            fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        self.fs: Any = fs
        self.root: str = root.rstrip("/")

    @property
    def capabilities(self) -> Capabilities:
        """No exclusive create; file times where the file system reports them."""
        dated = type(self.fs).modified is not AbstractFileSystem.modified
        return Capabilities(exclusive_create=False, modification_times=dated)

    def _abs(self, path: str) -> str:
        return self.root if path == "" else f"{self.root}/{check_relpath(path)}"

    def make_dir(self, path: str) -> None:
        target = self._abs(path)
        with self._translating("create folder", target):
            self.fs.makedirs(target, exist_ok=True)

    def _info(self, target: str) -> dict[str, Any]:
        """The object's own metadata, not a cached listing's."""
        self.fs.invalidate_cache(target)
        return dict(self.fs.info(target))

    def open_file(self, path: str, size: int | None = None) -> FileSink:
        target = self._abs(path)
        with self._translating("create", target):
            handle = self.fs.open(target, "wb", autocommit=False, block_size=self.block_size)
        return TranslatingSink(self._translating, _FsspecSink(self, target, handle), target)

    def sync_dir(self, path: str) -> None:
        """Object stores make each completed write durable on its own."""

    def _write_whole(self, path: str, data: bytes) -> None:
        """One ``pipe_file``: a single PUT on object stores."""
        target = self._abs(path)
        with self._translating("publish", target):
            self.fs.pipe_file(target, data, mode="overwrite")

    def read_into(self, path: str, buffer: memoryview, offset: int = 0) -> None:
        target = self._abs(path)
        with self._translating("read", target):
            data = self.fs.cat_file(target, start=offset, end=offset + len(buffer))
            if len(data) != len(buffer):
                raise StorageError(errno.EIO, f"read {target}: file is shorter than expected")
            buffer[:] = data

    def size(self, path: str) -> int:
        target = self._abs(path)
        with self._translating("stat", target):
            info = self._info(target)
            if info.get("type") != "file":
                raise StorageError(errno.EINVAL, f"refusing {target}: not a file")
            return int(info["size"])

    def modified(self, path: str) -> float | None:
        target = self._abs(path)
        with self._translating("stat", target):
            info = self._info(target)
        return timestamp(info.get("LastModified", info.get("mtime", info.get("created"))))

    def list_dir(self, path: str) -> list[str]:
        target = self._abs(path)
        try:
            with self._translating("list", target):
                self.fs.invalidate_cache(target)
                entries = self.fs.ls(target, detail=False)
        except StorageNotFoundError:
            return []
        prefix = target.rstrip("/") + "/"
        names = {e.rstrip("/")[len(prefix) :] for e in entries if e.startswith(prefix)}
        return sorted(n for n in names if n and "/" not in n)

    def remove_file(self, path: str) -> None:
        target = self._abs(path)
        with contextlib.suppress(StorageNotFoundError), self._translating("remove", target):
            self.fs.rm_file(target)

    def remove_dir(self, path: str) -> None:
        target = self._abs(path)
        self.fs.invalidate_cache(target)  # rm lists what to delete: list it afresh
        with (
            contextlib.suppress(StorageNotFoundError),
            self._translating("remove folder", target),
        ):
            self.fs.rm(target, recursive=True)
        self.fs.invalidate_cache(target)


class TranslatingSink:
    """A FileSink whose backend errors leave as StorageError: ``translate(action, path)`` is
    the store's translation (a context manager)."""

    def __init__(self, translate: Translate, sink: FileSink, target: str) -> None:
        self._translate = translate
        self._sink = sink
        self._target = target

    def write(self, data: BytesLike) -> None:
        with self._translate("upload", self._target):
            self._sink.write(data)

    def commit(self) -> None:
        with self._translate("upload", self._target):
            self._sink.commit()

    def discard(self) -> None:
        self._sink.discard()


class _FsspecSink:
    """An fsspec file opened with autocommit=False; raw backend errors (wrap it)."""

    def __init__(self, store: FsspecStore, target: str, handle: Any) -> None:
        self._store = store
        self._target = target
        self._handle = handle

    def write(self, data: BytesLike) -> None:
        self._handle.write(data)

    def commit(self) -> None:
        self._handle.close()
        commit = getattr(self._handle, "commit", None)
        if commit is not None and not getattr(self._handle, "autocommit", False):
            commit()

    def discard(self) -> None:
        handle = self._handle
        with contextlib.suppress(Exception):
            if hasattr(handle, "discard"):
                handle.discard()
        # A discarded fsspec file must not flush again when garbage-collected.
        with contextlib.suppress(Exception):
            handle.closed = True
        if getattr(handle, "autocommit", True):
            # No real uncommitted upload here (memory://): the key is already visible.
            with contextlib.suppress(Exception):
                self._store.fs.rm_file(self._target)


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
