"""The read-only Store a restoring client reads a held checkpoint through: the client's
side of the memory tier (the service's is ``memtier.py``).

A client gets a held step's segment read-only and wraps it in ``MemoryStore`` (alone,
or under ``overlay.OverlayStore`` for a many-rank save's share), so restore's one
reader of the format reads it with every check it makes on storage. No torch here.
"""

from __future__ import annotations

import errno
import mmap
from collections.abc import Iterator, Mapping
from typing import NoReturn

from checkpointd.daemon.wire.protocol import HeldFile
from checkpointd.errors import StorageError, StorageNotFoundError
from checkpointd.storage import FileSink, Store

__all__ = ["MemoryStore", "ReadOnlyStore"]


class ReadOnlyStore(Store):
    """A Store that only reads: every write refuses with EROFS (the memory tier's
    stores: nothing restoring from memory may change it or storage)."""

    url: str

    def _refuse(self, path: str) -> NoReturn:
        raise StorageError(errno.EROFS, f"{self.url}/{path}: read-only (restoring from memory)")

    def make_dir(self, path: str) -> None:
        self._refuse(path)

    def open_file(self, path: str, size: int | None = None) -> FileSink:
        self._refuse(path)

    def sync_dir(self, path: str) -> None:
        self._refuse(path)

    def remove_file(self, path: str) -> None:
        self._refuse(path)

    def remove_dir(self, path: str) -> None:
        self._refuse(path)


class MemoryStore(ReadOnlyStore):
    """A read-only Store over one held checkpoint: ``files`` (paths relative to the
    root) made of a head and a range of a read-only mapped segment. Any thread."""

    def __init__(self, url: str, files: Mapping[str, tuple[bytes, memoryview]]) -> None:
        self.url = url
        self._files = dict(files)

    @classmethod
    def over(
        cls, url: str, folder: str, manifest: bytes, files: list[HeldFile], mapped: mmap.mmap
    ) -> MemoryStore:
        """The store of a ``Held`` reply: ``manifest`` (the bytes read from storage) and
        the held files in step folder ``folder``."""
        whole = memoryview(mapped)
        parts: dict[str, tuple[bytes, memoryview]] = {
            f"{folder}/manifest.json": (manifest, whole[:0])
        }
        for file in files:
            if not 0 <= file.offset <= file.offset + file.length <= len(whole):
                raise StorageError(errno.EINVAL, f"{url}: held file {file.path} is out of range")
            parts[f"{folder}/{file.path}"] = (
                file.head,
                whole[file.offset : file.offset + file.length],
            )
        return cls(url, parts)

    def _parts(self, path: str) -> tuple[bytes, memoryview]:
        try:
            return self._files[path]
        except KeyError:
            raise StorageNotFoundError(
                errno.ENOENT, f"{self.url}/{path}: not in the memory tier"
            ) from None

    def holds(self, path: str) -> bool:
        """True if file ``path`` is in this held copy."""
        return path in self._files

    def size(self, path: str) -> int:
        head, body = self._parts(path)
        return len(head) + len(body)

    def read_into(self, path: str, buffer: memoryview, offset: int = 0) -> None:
        head, body = self._parts(path)
        _HeldFile(f"{self.url}/{path}", head, body).read_into(buffer, offset)

    def open_pinned(self, path: str) -> _HeldFile:
        """The held file, in memory (``storage.MappedFile``): restore copies its bytes
        out once and checks them where they landed (the service lends the segment until
        the client's connection ends and never reuses it, but any process that can map
        it could still write into it, so what is read twice is never trusted twice)."""
        head, body = self._parts(path)
        return _HeldFile(f"{self.url}/{path}", head, body)

    def list_dir(self, path: str) -> list[str]:
        prefix = f"{path}/" if path else ""
        names = {p[len(prefix) :].split("/")[0] for p in self._files if p.startswith(prefix)}
        return sorted(names)


def _chunks(
    head: bytes, body: memoryview, offset: int, want: int
) -> Iterator[tuple[int, memoryview]]:
    """(position in the buffer, bytes) covering ``want`` bytes of head+body from ``offset``."""
    at = 0
    if offset < len(head):
        part = memoryview(head)[offset : offset + want]
        yield 0, part
        at = len(part)
    rest = want - at
    if rest:
        start = max(0, offset - len(head))
        yield at, body[start : start + rest]


class _HeldFile:
    """One held file (a head, then a range of the segment): ``storage.MappedFile``."""

    def __init__(self, where: str, head: bytes, body: memoryview) -> None:
        self._where = where
        self._head = head
        self._body = body

    def views(self, offset: int, length: int) -> list[memoryview]:
        if offset < 0 or length < 0 or offset + length > len(self._head) + len(self._body):
            raise StorageError(errno.EIO, f"{self._where}: read past the end")
        return [view for _, view in _chunks(self._head, self._body, offset, length) if view]

    def read_into(self, buffer: memoryview, offset: int = 0) -> None:
        at = 0
        for view in self.views(offset, len(buffer)):
            buffer[at : at + len(view)] = view
            at += len(view)

    def unchanged(self) -> bool:
        """Always True: a mapping keeps no record of writes into it, so readers never
        rely on it for a held file (they check the bytes that landed instead)."""
        return True

    def close(self) -> None:
        """Nothing to close: the mapping is the restoring client's (recall.py)."""
