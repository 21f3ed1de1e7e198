"""An example third storage backend in one module: ``dictfs://name`` roots kept in a dict.

It shows what a backend needs: a Store subclass with the abstract methods, its
declared Capabilities, and a ``register_store`` call. Files live in one
process-wide dict, so every store of the same root sees the same files; one
lock makes publish an atomic create-if-absent. Any thread.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Mapping
from typing import Any

from checkpointd.errors import CheckpointExistsError, StorageError, StorageNotFoundError
from checkpointd.format.checksum import BytesLike
from checkpointd.storage import Capabilities, FileSink, Store, check_relpath, register_store

_FILES: dict[str, bytes] = {}
_LOCK = threading.Lock()


class DictStore(Store):
    """A root ``dictfs://name``: files in a dict, folders implied by the names."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.url = url
        self.root = url.removeprefix("dictfs://").rstrip("/")

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(exclusive_create=True)

    def _key(self, path: str) -> str:
        return self.root if path == "" else f"{self.root}/{check_relpath(path)}"

    def make_dir(self, path: str) -> None:
        self._key(path)

    def open_file(self, path: str, size: int | None = None) -> FileSink:
        return _DictSink(self._key(path))

    def sync_dir(self, path: str) -> None:
        pass

    def _publish_exclusive(self, path: str, data: bytes) -> None:
        key = self._key(path)
        with _LOCK:
            if key in _FILES:
                raise CheckpointExistsError(f"{self.url}/{path} already exists")
            _FILES[key] = bytes(data)

    def read_into(self, path: str, buffer: memoryview, offset: int = 0) -> None:
        data = _FILES.get(self._key(path))
        if data is None:
            raise StorageNotFoundError(errno.ENOENT, f"{self.url}/{path}: no such file")
        if offset + len(buffer) > len(data):
            raise StorageError(errno.EIO, f"{self.url}/{path}: file is shorter than expected")
        buffer[:] = data[offset : offset + len(buffer)]

    def size(self, path: str) -> int:
        data = _FILES.get(self._key(path))
        if data is None:
            raise StorageNotFoundError(errno.ENOENT, f"{self.url}/{path}: no such file")
        return len(data)

    def list_dir(self, path: str) -> list[str]:
        prefix = self._key(path) + "/"
        with _LOCK:
            return sorted({k[len(prefix) :].split("/")[0] for k in _FILES if k.startswith(prefix)})

    def remove_file(self, path: str) -> None:
        with _LOCK:
            _FILES.pop(self._key(path), None)

    def remove_dir(self, path: str) -> None:
        prefix = self._key(path) + "/"
        with _LOCK:
            for key in [k for k in _FILES if k.startswith(prefix)]:
                del _FILES[key]


class _DictSink:
    """Buffers the bytes; commit stores them under the key at once."""

    def __init__(self, key: str) -> None:
        self._key = key
        self._data = bytearray()

    def write(self, data: BytesLike) -> None:
        self._data += memoryview(data).cast("B")

    def commit(self) -> None:
        with _LOCK:
            _FILES[self._key] = bytes(self._data)

    def discard(self) -> None:
        self._data = bytearray()


register_store("dictfs", DictStore)
