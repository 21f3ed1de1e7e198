"""The storage interface every backend implements, and what a backend declares it can do.

Every method is blocking and may be called from any thread; the writer calls
them from worker threads of its event loop, readers from the caller's thread.
Paths are relative to the store's root, ``/``-separated, and checked so that
nothing is read or written outside it. Every backend error leaves a store as
a StorageError (or CheckpointExistsError / StorageNotFoundError): each backend
module translates its own errors with ``translate_errors``.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import re
import threading
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

from checkpointd.errors import (
    CheckpointExistsError,
    StorageCapabilityWarning,
    StorageError,
    StorageFullError,
    StorageNotFoundError,
    StoragePermissionError,
)
from checkpointd.format.checksum import BytesLike
from checkpointd.format.layout import TEMP_MARKER

__all__ = [
    "TEMP_MARKER",
    "Capabilities",
    "FileSink",
    "MappedFile",
    "PendingUpload",
    "PinnedFile",
    "Store",
    "check_relpath",
    "shown",
    "translate_errors",
    "translate_os_error",
]

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_PERMISSION_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS}
_WARN_LOCK = threading.Lock()
# A URL in text: its scheme, then a user (and password) before an "@" in its host part,
# the rest of its host and path, and a query (a signed URL's token).
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)([^/\s]*@)?([^\s?]*)(\?\S*)?")


def shown(text: str) -> str:
    """``text`` (a root, a URL or a message naming one) as it may be logged or shown: each
    URL's ``user:password@`` and query masked (``***``). Storage options never appear in
    a root or a store's URL. Any thread."""
    return _URL.sub(lambda m: f"{m[1]}{'***@' if m[2] else ''}{m[3]}{'?***' if m[4] else ''}", text)


@contextlib.contextmanager
def translate_errors(
    action: str, path: str, backend_errors: tuple[type[BaseException], ...] = ()
) -> Iterator[None]:
    """Re-raise OSError and instances of ``backend_errors`` from the body as StorageError types.

    Each backend passes the error types of its own client library; anything
    else (a bug) propagates unchanged."""
    try:
        yield
    except (StorageError, CheckpointExistsError):
        raise
    except OSError as exc:
        raise translate_os_error(exc, action, path) from exc
    except backend_errors as exc:
        raise StorageError(f"{action} {path}: {type(exc).__name__}: {exc}") from exc


def translate_os_error(exc: OSError, action: str, path: str) -> StorageError:
    """The StorageError type for ``exc`` by its errno (not found, permission, full, other)."""
    detail = exc.strerror or str(exc) or type(exc).__name__
    message = f"{action} {path}: {detail}"
    if isinstance(exc, FileNotFoundError) or exc.errno == errno.ENOENT:
        return StorageNotFoundError(errno.ENOENT, message)
    if isinstance(exc, PermissionError) or exc.errno in _PERMISSION_ERRNOS:
        return StoragePermissionError(exc.errno or errno.EACCES, message)
    if exc.errno in _FULL_ERRNOS:
        return StorageFullError(exc.errno, message)
    return StorageError(exc.errno or errno.EIO, message)


def check_relpath(path: str) -> str:
    """Return ``path`` if it is a relative path that stays inside the root, else raise."""
    parts = path.split("/")
    if not path or path.startswith("/") or "\\" in path or any(p in ("", ".", "..") for p in parts):
        raise StorageError(errno.EINVAL, f"refusing path {path!r}: not a plain relative path")
    return path


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a store promises beyond the Store interface; the commit protocol, the
    reader and cleanup check these instead of assuming them. Reading them never
    touches the storage."""

    exclusive_create: bool | None
    """``publish`` is an atomic create-if-absent: of two writers racing to publish one
    path exactly one wins. Where False, publish checks before and reads back after
    (so it never silently overwrites) but two racing writers may both succeed. None:
    it depends on the server and is not known yet (``Store.exclusive_create`` asks)."""
    memory_map: bool = False
    """``map_file`` returns a memory map of a file (else it raises StorageError)."""
    modification_times: bool = False
    """``modified`` returns when a file was last written (else None): cleanup can date
    leftovers only where this holds, and never removes what it cannot date."""
    pending_uploads: bool = False
    """Files are uploaded in parts that can outlive a dead writer; ``pending_uploads``
    lists them and ``abort_upload`` removes them (S3 multipart uploads)."""
    folders: bool = False
    """Folders are real, dated entries (``modified`` works on them); else folders are
    implicit prefixes of file names and exist only while they hold a file."""


@dataclass(frozen=True, slots=True)
class PendingUpload:
    """An upload started but never completed nor aborted (an S3 multipart upload)."""

    path: str
    """The key it would create, relative to the store's root."""
    upload_id: str
    modified: float
    """When it was started or last received a part (Unix seconds)."""


class PinnedFile(Protocol):
    """An open file that keeps showing the same file even if it is deleted or renamed
    meanwhile (a POSIX descriptor): ``Store.open_pinned``. Call ``close`` once when
    done; ``read_into`` may be called from any thread, also concurrently."""

    def read_into(self, buffer: memoryview, offset: int = 0) -> None:
        """Fill ``buffer`` from byte ``offset``; a short file raises StorageError."""

    def unchanged(self) -> bool:
        """Whether nothing has written into the file since it was opened, as far as its
        metadata shows (its size and modification time: a write through any descriptor
        or map sets it; deleting or renaming the file does not count). Restore lands
        bytes it checked once from a file still unchanged after the landing reads
        (read/landing.py)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class MappedFile(PinnedFile, Protocol):
    """A pinned file whose bytes are already in this process's memory (the checkpoint
    service's memory tier, which checkpointd never writes while it is lent): ``views``
    gives them without a copy. Its ``unchanged`` cannot see a write into that memory
    by another process, so a reader checks the bytes it copied out, never the mapping
    before reading it again."""

    def views(self, offset: int, length: int) -> list[memoryview]:
        """The ``length`` bytes from ``offset``, as one or more read-only pieces in
        order; StorageError past the end. Valid until ``close``."""
        ...


class FileSink(Protocol):
    """A file being written. Call ``write`` any number of times, then exactly one of
    ``commit`` (durable and visible under its final name) or ``discard`` (no trace left).
    ``discard`` is also safe after a failed ``write`` or ``commit``. One thread at a time."""

    def write(self, data: BytesLike) -> None: ...

    def commit(self) -> None: ...

    def discard(self) -> None: ...


_NOTHING_EXTRA = Capabilities(exclusive_create=False)


class Store(ABC):
    """A checkpoint root on some storage. Methods block; any thread may call them.

    A backend implements the abstract methods and declares ``capabilities``; the
    template ``publish`` picks the exclusive or the guarded path from them."""

    url: str
    """The root as the user gave it, for messages."""

    backend_errors: ClassVar[tuple[type[BaseException], ...]] = ()
    """Error types of the backend's client library, translated to StorageError."""

    _warned_not_exclusive: bool = False

    @property
    def capabilities(self) -> Capabilities:
        """What this store can do, without asking the storage.

        By default nothing beyond the interface: each backend declares its own."""
        return _NOTHING_EXTRA

    @property
    def exclusive_create(self) -> bool:
        """True if ``publish`` is an atomic create-if-absent. Where the capability
        depends on the server (None), asks it once (then cached); publish calls this."""
        return bool(self.capabilities.exclusive_create)

    def _translating(self, action: str, path: str) -> contextlib.AbstractContextManager[None]:
        return translate_errors(action, path, self.backend_errors)

    @abstractmethod
    def make_dir(self, path: str) -> None:
        """Create folder ``path`` (and parents) durably; no-op where folders are implicit."""

    @abstractmethod
    def open_file(self, path: str, size: int | None = None) -> FileSink:
        """Start writing ``path``; nothing is visible there until the sink commits.

        ``size``: the bytes that will be written, where known; stores that cut
        uploads into parts use it to choose parts that fit (StorageFullError up
        front if the file cannot fit at all)."""

    @abstractmethod
    def sync_dir(self, path: str) -> None:
        """Make the renames committed into folder ``path`` durable (call before publishing)."""

    def publish(self, path: str, data: bytes) -> None:
        """Durably create ``path`` with ``data`` in one step, only if it does not exist.

        Raises CheckpointExistsError if it exists (another writer won); never
        overwrites an existing file. Exclusive against a concurrent publish only
        where ``exclusive_create``; elsewhere it warns once per store
        (StorageCapabilityWarning) and publishes guarded."""
        if self.exclusive_create:
            self._publish_exclusive(path, data)
            return
        self._warn_not_exclusive()
        self._publish_guarded(path, data)

    def _publish_exclusive(self, path: str, data: bytes) -> None:
        """An atomic create-if-absent; stores declaring exclusive_create override this."""
        raise NotImplementedError(f"{type(self).__name__} declares no exclusive create")

    def _publish_guarded(self, path: str, data: bytes) -> None:
        """Publish without an atomic create: never over an existing file, and only ours after.

        Two writers that both pass the check before either write lands can still
        both succeed (the warning says so); one whose file is overwritten raises."""
        if self.exists(path):
            if self._holds(path, data):
                return  # a retried publish whose first attempt landed
            raise CheckpointExistsError(f"{self.url}/{path} already exists")
        self._write_whole(path, data)
        self.sync_dir(path.rpartition("/")[0])
        if not self._holds(path, data):
            raise CheckpointExistsError(
                f"{self.url}/{path}: another writer published it at the same time (this "
                "storage cannot create exclusively)"
            )

    def _write_whole(self, path: str, data: bytes) -> None:
        """Write ``path`` with ``data`` (replacing it), as the guarded publish's one write."""
        sink = self.open_file(path, len(data))
        try:
            sink.write(data)
            sink.commit()
        except BaseException:
            sink.discard()
            raise

    def _holds(self, path: str, data: bytes) -> bool:
        """True if ``path`` exists now with exactly ``data``."""
        try:
            return self.read_bytes(path) == data
        except StorageError:
            return False

    def _warn_not_exclusive(self) -> None:
        with _WARN_LOCK:
            if self._warned_not_exclusive:
                return
            self._warned_not_exclusive = True
        warnings.warn(
            f"{self.url}: this storage cannot create a file exclusively (no atomic "
            "create-if-absent, e.g. no If-None-Match), so publishing a manifest is not "
            "exclusive: two writers saving the same step at the same moment are not "
            "excluded (a manifest is still never overwritten)",
            StorageCapabilityWarning,
            stacklevel=3,
        )

    @abstractmethod
    def read_into(self, path: str, buffer: memoryview, offset: int = 0) -> None:
        """Fill ``buffer`` from ``path`` starting at byte ``offset``; short files raise."""

    def read_into_sized(self, path: str, buffer: memoryview, offset: int = 0) -> int:
        """The size of file ``path``, and ``buffer`` filled from byte ``offset`` if the file
        is long enough (else left as it is: the caller reports the mismatch). Stores whose
        reads tell the size anyway (S3's Content-Range) save the separate size request."""
        size = self.size(path)
        if len(buffer) and offset + len(buffer) <= size:
            self.read_into(path, buffer, offset)
        return size

    @abstractmethod
    def size(self, path: str) -> int:
        """Size in bytes of regular file ``path``; StorageNotFoundError if absent."""

    @abstractmethod
    def list_dir(self, path: str) -> list[str]:
        """Sorted names of the entries directly in folder ``path`` (``""`` is the root)."""

    @abstractmethod
    def remove_file(self, path: str) -> None:
        """Remove ``path`` if it exists (durably where the storage allows)."""

    @abstractmethod
    def remove_dir(self, path: str) -> None:
        """Remove folder ``path`` and everything in it, if it exists."""

    def read_bytes(self, path: str, offset: int = 0, size: int | None = None) -> bytes:
        """Read ``size`` bytes (default: to the end) of ``path`` from ``offset``."""
        if size is None:
            size = self.size(path) - offset
        buffer = bytearray(size)
        self.read_into(path, memoryview(buffer), offset)
        return bytes(buffer)

    def open_pinned(self, path: str) -> PinnedFile | None:
        """``path`` opened so that later reads see this file even if it is deleted or
        renamed meanwhile, or None where the store cannot promise that (the default).

        ``restore`` checks a file through a small buffer, then reads it again straight
        into live tensors: only a pinned file guarantees both reads see the same file.
        A ``MappedFile`` (bytes in memory, unwritten while open) is checked in place."""
        return None

    def map_file(self, path: str) -> mmap.mmap:
        """A private (copy-on-write) memory map of regular file ``path``, non-empty.

        Only where ``capabilities.memory_map``; elsewhere StorageError (ENOTSUP)."""
        raise StorageError(errno.ENOTSUP, f"{self.url}: this storage cannot map {path}")

    def exists(self, path: str) -> bool:
        """True if regular file ``path`` exists."""
        try:
            self.size(path)
        except StorageNotFoundError:
            return False
        return True

    def modified(self, path: str) -> float | None:
        """When file ``path`` was last modified (Unix seconds), None if the store cannot
        say (``capabilities.modification_times`` False). StorageNotFoundError if absent."""
        self.size(path)
        return None

    def pending_uploads(self) -> list[PendingUpload]:
        """Uploads under the root that were started and neither completed nor aborted."""
        return []

    def abort_upload(self, upload: PendingUpload) -> None:  # noqa: B027 - no uploads by default
        """Abort ``upload`` (from pending_uploads); a no-op if it is already gone."""

    def close(self) -> None:  # noqa: B027 - optional hook, most stores hold nothing
        """Release what the store holds; the store must not be used afterwards."""
