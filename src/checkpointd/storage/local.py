"""LocalStore: a root folder on a POSIX file system.

Files are written as ``{final}.tmp-<random>``, fsynced, renamed onto their
final name, and the folder fsynced; large aligned writes bypass the page cache
(directio.py). Only OSError is translated here: nothing else does I/O.
Blocking; any thread.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import shutil
import stat

from checkpointd import tunables
from checkpointd.errors import CheckpointExistsError, StorageError, StorageNotFoundError
from checkpointd.format.checksum import BytesLike
from checkpointd.storage.base import (
    TEMP_MARKER,
    Capabilities,
    FileSink,
    PinnedFile,
    Store,
    check_relpath,
    translate_errors,
)
from checkpointd.storage.directio import write_direct

__all__ = ["LocalStore"]

_CAPABILITIES = Capabilities(
    exclusive_create=True, memory_map=True, modification_times=True, folders=True
)


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

    @property
    def capabilities(self) -> Capabilities:
        """Exclusive create by hard link; maps, file and folder times."""
        return _CAPABILITIES

    def _publish_exclusive(self, path: str, data: bytes) -> None:
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
                _pread_all(fd, buffer, offset, target)
            finally:
                os.close(fd)

    def open_pinned(self, path: str) -> PinnedFile:
        """An open descriptor on regular file ``path``: deleting or renaming the file
        (retention, gc) does not change what it reads."""
        target = self._abs(path)
        with translate_errors("open", target):
            return _PinnedLocal(self._open_regular(target), target)

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


def _pread_all(fd: int, buffer: memoryview, offset: int, target: str) -> None:
    """Fill ``buffer`` from ``fd`` at ``offset`` (positional reads, no shared file offset)."""
    done = 0
    while done < len(buffer):
        n = os.preadv(fd, [buffer[done:]], offset + done)
        if n == 0:
            raise StorageError(errno.EIO, f"read {target}: file is shorter than expected")
        done += n


class _PinnedLocal:
    """``LocalStore.open_pinned``: positional reads on one descriptor, any thread."""

    def __init__(self, fd: int, target: str) -> None:
        self._fd = fd
        self._target = target
        try:
            self._stamp = _stamp(fd, target)
        except BaseException:
            os.close(fd)
            raise

    def read_into(self, buffer: memoryview, offset: int = 0) -> None:
        with translate_errors("read", self._target):
            _pread_all(self._fd, buffer, offset, self._target)

    def unchanged(self) -> bool:
        return _stamp(self._fd, self._target) == self._stamp

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


def _stamp(fd: int, target: str) -> tuple[int, int, int, int]:
    """What a write into the open file ``fd`` changes: its size and modification time (a
    write through any descriptor or shared map sets it), with the inode it is. Not the
    status-change time: deleting or renaming the file (retention, gc) sets that too."""
    with translate_errors("stat", target):
        info = os.fstat(fd)
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


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
            if self._direct and len(view) >= tunables.DIRECT_MIN_BYTES:
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
