"""Storage backends: POSIX local disk and any fsspec store (S3 first).

Every method is blocking and may be called from any thread; the writer calls
them from worker threads of its event loop, readers from the caller's thread.
Paths are relative to the store's root, ``/``-separated, and checked so that
nothing is read or written outside it. Every backend error leaves this module
as a StorageError (or CheckpointExistsError / StorageNotFoundError).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import shutil
import stat
import threading
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from checkpointd.checksum import BytesLike
from checkpointd.directio import DIRECT_MIN_BYTES, write_direct
from checkpointd.errors import (
    CheckpointExistsError,
    StorageCapabilityWarning,
    StorageError,
    StorageFullError,
    StorageNotFoundError,
    StoragePermissionError,
)
from checkpointd.layout import TEMP_MARKER
from checkpointd.s3 import (
    check_bucket,
    list_uploads,
    probe_exclusive_create,
    refused_as_existing,
    timestamp,
)
from checkpointd.s3upload import ParallelUploadSink, choose_part_size

__all__ = ["FileSink", "FsspecStore", "LocalStore", "PendingUpload", "Store", "open_store"]

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_PERMISSION_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS}
_BACKEND_MODULES = ("botocore", "aiobotocore", "aiohttp", "s3fs", "fsspec", "urllib3")


@contextlib.contextmanager
def translate_errors(action: str, path: str) -> Iterator[None]:
    """Re-raise OS and backend errors from the body as the project's StorageError types."""
    try:
        yield
    except (StorageError, CheckpointExistsError):
        raise
    except OSError as exc:
        raise _translate_os_error(exc, action, path) from exc
    except Exception as exc:
        if type(exc).__module__.split(".")[0] in _BACKEND_MODULES:
            raise StorageError(f"{action} {path}: {type(exc).__name__}: {exc}") from exc
        raise


def _translate_os_error(exc: OSError, action: str, path: str) -> StorageError:
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
class PendingUpload:
    """An upload started but never completed nor aborted (an S3 multipart upload)."""

    path: str
    """The key it would create, relative to the store's root."""
    upload_id: str
    modified: float
    """When it was started or last received a part (Unix seconds)."""


class FileSink(Protocol):
    """A file being written. Call ``write`` any number of times, then exactly one of
    ``commit`` (durable and visible under its final name) or ``discard`` (no trace left).
    ``discard`` is also safe after a failed ``write`` or ``commit``. One thread at a time."""

    def write(self, data: BytesLike) -> None: ...

    def commit(self) -> None: ...

    def discard(self) -> None: ...


class Store(ABC):
    """A checkpoint root on some storage. Methods block; any thread may call them."""

    url: str
    """The root as the user gave it, for messages."""

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

    @abstractmethod
    def publish(self, path: str, data: bytes) -> None:
        """Durably create ``path`` with ``data`` in one atomic step, only if it does not exist.

        Raises CheckpointExistsError if it exists (another writer won). Never
        overwrites an existing file; exclusive against a concurrent publish only
        where ``exclusive_create`` is True."""

    @property
    def exclusive_create(self) -> bool:
        """True if ``publish`` is an atomic create-if-absent, so two writers racing to
        publish one path cannot both win. May ask the storage once (then cached)."""
        return True

    @abstractmethod
    def read_into(self, path: str, buffer: memoryview, offset: int = 0) -> None:
        """Fill ``buffer`` from ``path`` starting at byte ``offset``; short files raise."""

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

    def exists(self, path: str) -> bool:
        """True if regular file ``path`` exists."""
        try:
            self.size(path)
        except StorageNotFoundError:
            return False
        return True

    def modified(self, path: str) -> float | None:
        """When file ``path`` was last modified (Unix seconds), None if the store cannot say.

        StorageNotFoundError if it is absent."""
        self.size(path)
        return None

    def pending_uploads(self) -> list[PendingUpload]:
        """Uploads under the root that were started and neither completed nor aborted."""
        return []

    def abort_upload(self, upload: PendingUpload) -> None:  # noqa: B027 - no uploads by default
        """Abort ``upload`` (from pending_uploads); a no-op if it is already gone."""

    def close(self) -> None:  # noqa: B027 - optional hook, most stores hold nothing
        """Release what the store holds; the store must not be used afterwards."""


# ---------------------------------------------------------------------------
# Local disk


class LocalStore(Store):
    """A root folder on a POSIX file system, with temp-file, fsync, rename and folder fsync."""

    def __init__(self, root: str) -> None:
        self.url = root
        self.root = os.path.abspath(os.path.expanduser(root))
        self._real_root = os.path.realpath(self.root)

    def _abs(self, path: str) -> str:
        if path == "":
            return self.root
        return os.path.join(self.root, *check_relpath(path).split("/"))

    def make_dir(self, path: str) -> None:
        target = self._abs(path)
        with translate_errors("create folder", target):
            missing: list[str] = []
            current = target
            while not os.path.isdir(current):
                missing.append(current)
                current = os.path.dirname(current)
            for folder in reversed(missing):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(folder)
                _fsync_dir(os.path.dirname(folder))

    def open_file(self, path: str, size: int | None = None) -> FileSink:
        return _LocalSink(self._abs(path))

    def sync_dir(self, path: str) -> None:
        target = self._abs(path)
        with translate_errors("sync folder", target):
            _fsync_dir(target)

    def publish(self, path: str, data: bytes) -> None:
        final = self._abs(path)
        sink = _LocalSink(final)
        try:
            sink.write(data)
            sink.commit(exclusive=True)
        except BaseException:
            sink.discard()
            raise
        try:
            self.sync_dir(path.rpartition("/")[0])
        except BaseException:
            # Linked but maybe not durable: withdraw it, so a failed publish is never visible.
            with contextlib.suppress(OSError):
                os.unlink(final)
            raise

    def _open_regular(self, target: str) -> int:
        """Open ``target`` for reading, refusing links, FIFOs, devices and escapes from root."""
        real = os.path.realpath(target)
        if real != self._real_root and not real.startswith(self._real_root + os.sep):
            raise StorageError(errno.EACCES, f"refusing {target}: it resolves outside the root")
        flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC
        fd = os.open(target, flags)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise StorageError(errno.EINVAL, f"refusing {target}: not a regular file")
        return fd

    def read_into(self, path: str, buffer: memoryview, offset: int = 0) -> None:
        target = self._abs(path)
        with translate_errors("read", target):
            fd = self._open_regular(target)
            try:
                done = 0
                while done < len(buffer):
                    n = os.preadv(fd, [buffer[done:]], offset + done)
                    if n == 0:
                        raise StorageError(
                            errno.EIO, f"read {target}: file is shorter than expected"
                        )
                    done += n
            finally:
                os.close(fd)

    def map_file(self, path: str) -> mmap.mmap:
        """A private (copy-on-write) memory map of regular file ``path``, non-empty.

        Writes to the map never reach the file. Loading maps large files instead
        of reading them: no copy out of the page cache (restore.py)."""
        target = self._abs(path)
        with translate_errors("map", target):
            fd = self._open_regular(target)
            try:
                return mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
            finally:
                os.close(fd)

    def size(self, path: str) -> int:
        target = self._abs(path)
        with translate_errors("stat", target):
            info = os.lstat(target)
            if not stat.S_ISREG(info.st_mode):
                raise StorageError(errno.EINVAL, f"refusing {target}: not a regular file")
            return info.st_size

    def modified(self, path: str) -> float | None:
        target = self._abs(path)
        with translate_errors("stat", target):
            return os.lstat(target).st_mtime

    def list_dir(self, path: str) -> list[str]:
        target = self._abs(path)
        try:
            with translate_errors("list", target):
                return sorted(os.listdir(target))
        except StorageNotFoundError:
            return []

    def remove_file(self, path: str) -> None:
        target = self._abs(path)
        with translate_errors("remove", target):
            try:
                os.unlink(target)
            except FileNotFoundError:
                return
            _fsync_dir(os.path.dirname(target))

    def remove_dir(self, path: str) -> None:
        target = self._abs(path)
        with translate_errors("remove folder", target):
            try:
                shutil.rmtree(target)
            except FileNotFoundError:
                return
            _fsync_dir(os.path.dirname(target))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _LocalSink:
    """Writes ``{final}.tmp-<random>``; commit fsyncs it and renames it onto ``final``."""

    def __init__(self, final: str) -> None:
        self.final = final
        self.temp = f"{final}{TEMP_MARKER}{secrets.token_hex(6)}"
        self._fd: int | None = None
        with translate_errors("create", self.temp):
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
            self._fd = os.open(self.temp, flags, 0o644)
        self._direct = True  # large aligned writes bypass the page cache (directio.py)

    def write(self, data: BytesLike) -> None:
        assert self._fd is not None, "write after commit or discard"
        view = memoryview(data).cast("B")
        with translate_errors("write", self.temp):
            if self._direct and len(view) >= DIRECT_MIN_BYTES:
                view, self._direct = write_direct(self._fd, view)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]

    def commit(self, *, exclusive: bool = False) -> None:
        """fsync, close, then rename onto the final name (link for ``exclusive``).

        The caller fsyncs the folder afterwards (Store.sync_dir). A failed fsync is
        final: the data may be lost, so the caller must discard, never retry."""
        assert self._fd is not None, "commit after commit or discard"
        with translate_errors("fsync", self.temp):
            os.fsync(self._fd)
        fd, self._fd = self._fd, None
        with translate_errors("close", self.temp):
            os.close(fd)
        with translate_errors("rename", self.final):
            if exclusive:
                self._link_exclusive()
            else:
                os.replace(self.temp, self.final)

    def _link_exclusive(self) -> None:
        try:
            os.link(self.temp, self.final)
        except FileExistsError:
            raise CheckpointExistsError(f"{self.final} already exists") from None
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise
            # Hard links unsupported here: fall back to check-then-rename.
            if os.path.lexists(self.final):
                raise CheckpointExistsError(f"{self.final} already exists") from None
            os.replace(self.temp, self.final)
            return
        os.unlink(self.temp)

    def discard(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(self.temp)


# ---------------------------------------------------------------------------
# fsspec stores (S3, GCS, memory, ...)


class FsspecStore(Store):
    """A root on an fsspec file system, treated as an object store.

    Files go straight to their final keys and become visible on commit (for S3:
    the single PUT or the completed multipart upload); discard aborts the upload.
    The manifest is created with ``If-None-Match: *`` where the store supports it
    (probed on first use: ``exclusive_create``); elsewhere publish checks before
    and reads back after its PUT, and warns once (StorageCapabilityWarning).
    Every existence, size and time check asks the object itself, never a cached
    listing: those checks guard deletions and commits. On S3 the bucket must
    exist (checked on construction); the store never creates one.
    """

    block_size: int = 16 * 2**20
    """Bytes per upload part (S3: at least 5 MiB; 10,000 parts make the largest file 160 GiB)."""

    parallel_parts: int = 4
    """S3 parts of one file uploaded at once (also the parts held in memory per file)."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        import fsspec

        self.url = url
        with translate_errors("open", url):
            fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        self.fs: Any = fs
        self.root: str = root.rstrip("/")
        self._lock = threading.Lock()
        self._exclusive: bool | None = None
        self._warned = False
        if self._is_s3():
            with translate_errors("open", url):
                check_bucket(fs, self.root, url)

    def _abs(self, path: str) -> str:
        return self.root if path == "" else f"{self.root}/{check_relpath(path)}"

    def make_dir(self, path: str) -> None:
        """Folders are implicit on S3, and s3fs's makedirs would create a missing bucket."""
        target = self._abs(path)
        if self._is_s3():
            return
        with translate_errors("create folder", target):
            self.fs.makedirs(target, exist_ok=True)

    def _info(self, target: str) -> dict[str, Any]:
        """The object's own metadata: s3fs would answer from the last listing otherwise."""
        if self._is_s3():
            return dict(self.fs.info(target, refresh=True))
        self.fs.invalidate_cache(target)
        return dict(self.fs.info(target))

    def open_file(self, path: str, size: int | None = None) -> FileSink:
        target = self._abs(path)
        if self._is_s3():
            part_size = choose_part_size(size, self.block_size)
            sink = ParallelUploadSink(
                self.fs, target, part_size=part_size, max_parallel=self.parallel_parts
            )
            return _TranslatingSink(sink, target)
        with translate_errors("create", target):
            handle = self.fs.open(target, "wb", autocommit=False, block_size=self.block_size)
        return _TranslatingSink(_FsspecSink(self, target, handle), target)

    def sync_dir(self, path: str) -> None:
        """Object stores make each completed PUT durable on its own."""

    @property
    def exclusive_create(self) -> bool:
        """Probed once per store: does a PUT with ``If-None-Match: *`` refuse an existing key?"""
        with self._lock:
            if self._exclusive is None:
                with translate_errors("probe exclusive create under", self.root):
                    self._exclusive = probe_exclusive_create(self._put, self.fs.rm_file, self.root)
            return self._exclusive

    def _put(self, target: str, data: bytes, exclusive: bool) -> None:
        self.fs.pipe_file(target, data, mode="create" if exclusive else "overwrite")

    def publish(self, path: str, data: bytes) -> None:
        target = self._abs(path)
        exclusive = self.exclusive_create
        if not exclusive:
            self._warn_not_exclusive()
        with translate_errors("publish", target):
            if exclusive:
                self._publish_exclusive(target, data)
            else:
                self._publish_guarded(target, data)

    def _publish_exclusive(self, target: str, data: bytes) -> None:
        try:
            self._put(target, data, exclusive=True)
        except OSError as exc:
            if not refused_as_existing(exc):
                raise
            # A retried PUT whose first attempt landed sees its own object: that is success.
            if self._holds(target, data):
                return
            raise CheckpointExistsError(f"{target} already exists") from None

    def _publish_guarded(self, target: str, data: bytes) -> None:
        """Publish without If-None-Match: never over an existing file, and only ours after.

        Two writers that both pass the check before either PUT lands can still both
        succeed (the warning says so); one whose PUT is overwritten raises."""
        if self._exists_now(target):
            if self._holds(target, data):
                return
            raise CheckpointExistsError(f"{target} already exists")
        self._put(target, data, exclusive=False)
        self.fs.invalidate_cache(target)
        if self.fs.cat_file(target) != data:
            raise CheckpointExistsError(
                f"{target}: another writer published it at the same time (this storage "
                "cannot create exclusively)"
            )

    def _exists_now(self, target: str) -> bool:
        try:
            return self._info(target).get("type") == "file"
        except FileNotFoundError:
            return False

    def _warn_not_exclusive(self) -> None:
        with self._lock:
            if self._warned:
                return
            self._warned = True
        warnings.warn(
            f"{self.url}: this storage ignores If-None-Match, so publishing a manifest is "
            "not exclusive: two writers saving the same step at the same moment are not "
            "excluded (a manifest is still never overwritten)",
            StorageCapabilityWarning,
            stacklevel=3,
        )

    def _holds(self, target: str, data: bytes) -> bool:
        try:
            self.fs.invalidate_cache(target)
            return bool(self.fs.cat_file(target) == data)
        except Exception:
            return False

    def read_into(self, path: str, buffer: memoryview, offset: int = 0) -> None:
        target = self._abs(path)
        with translate_errors("read", target):
            data = self.fs.cat_file(target, start=offset, end=offset + len(buffer))
            if len(data) != len(buffer):
                raise StorageError(errno.EIO, f"read {target}: file is shorter than expected")
            buffer[:] = data

    def size(self, path: str) -> int:
        target = self._abs(path)
        with translate_errors("stat", target):
            info = self._info(target)
            if info.get("type") != "file":
                raise StorageError(errno.EINVAL, f"refusing {target}: not a file")
            return int(info["size"])

    def modified(self, path: str) -> float | None:
        target = self._abs(path)
        with translate_errors("stat", target):
            info = self._info(target)
        return timestamp(info.get("LastModified", info.get("mtime", info.get("created"))))

    def _is_s3(self) -> bool:
        return "s3" in _protocols(self.fs)

    def pending_uploads(self) -> list[PendingUpload]:
        """Incomplete S3 multipart uploads whose key lies under the root (S3 only)."""
        if not self._is_s3():
            return []
        with translate_errors("list uploads", self.url):
            found = list_uploads(self.fs, self.root)
        return [PendingUpload(path, upload_id, last) for path, upload_id, last in found]

    def abort_upload(self, upload: PendingUpload) -> None:
        bucket, _, prefix = self.root.partition("/")
        key = f"{prefix}/{upload.path}" if prefix else upload.path
        with contextlib.suppress(StorageNotFoundError), translate_errors("abort upload", key):
            self.fs.call_s3(
                "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload.upload_id
            )

    def list_dir(self, path: str) -> list[str]:
        target = self._abs(path)
        try:
            with translate_errors("list", target):
                self.fs.invalidate_cache(target)
                entries = self.fs.ls(target, detail=False)
        except StorageNotFoundError:
            return []
        prefix = target.rstrip("/") + "/"
        names = {e.rstrip("/")[len(prefix) :] for e in entries if e.startswith(prefix)}
        return sorted(n for n in names if n and "/" not in n)

    def remove_file(self, path: str) -> None:
        target = self._abs(path)
        with contextlib.suppress(StorageNotFoundError), translate_errors("remove", target):
            self.fs.rm_file(target)

    def remove_dir(self, path: str) -> None:
        target = self._abs(path)
        self.fs.invalidate_cache(target)  # rm lists what to delete: list it afresh
        with contextlib.suppress(StorageNotFoundError), translate_errors("remove folder", target):
            self.fs.rm(target, recursive=True)
        self.fs.invalidate_cache(target)


class _TranslatingSink:
    """A FileSink whose backend errors leave as StorageError."""

    def __init__(self, sink: FileSink, target: str) -> None:
        self._sink = sink
        self._target = target

    def write(self, data: BytesLike) -> None:
        with translate_errors("upload", self._target):
            self._sink.write(data)

    def commit(self) -> None:
        with translate_errors("upload", self._target):
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


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def open_store(root: str, storage_options: Mapping[str, Any] | None = None) -> Store:
    """Open the store for a local path, a ``file://`` URL, or another fsspec URL."""
    if "://" not in root:
        if storage_options:
            raise StorageError(errno.EINVAL, "storage_options are only for fsspec URLs")
        return LocalStore(root)
    if root.startswith("file://"):
        return LocalStore(root.removeprefix("file://"))
    return FsspecStore(root, storage_options)
