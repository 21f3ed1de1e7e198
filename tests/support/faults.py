"""Fault injection at the level of LocalStore's system calls.

``FaultyOS`` stands in for the ``os`` module inside the modules of the storage
package that do local I/O, ``checkpointd.storage.local`` and
``checkpointd.storage.directio`` (the O_DIRECT path for large aligned writes),
and for ``shutil.rmtree`` in local.py: every real file-system call still happens, but each
mutating call is counted and logged, and the wrapper can

- fail a chosen call with an errno (ENOSPC on a write, EIO on an fsync, ...);
  a write made while the file has ``O_DIRECT`` set (directio.write_direct) is the
  op ``write_direct``, every other write is ``write``;
- crash after the N-th mutating call: from then on every call raises
  ``SimulatedCrash``, so nothing the dying process does reaches the disk;
- model power loss at that crash (LevelDB's fault-injection env): bytes not
  fsynced are dropped, and every create/rename/link/unlink/mkdir/rmtree in a
  folder that was not fsynced afterwards is undone, newest first.

Use ``install(monkeypatch)``; call ``power_off()`` after a crash to apply the
losses, then ``uninstall`` (or let monkeypatch undo it) before checking the disk.
The wrapper keeps what it moved aside in a temporary folder made only when
needed and removed by ``cleanup()`` or, at the latest, when the wrapper is
garbage-collected.
"""

from __future__ import annotations

import fcntl
import os as real_os
import shutil
import stat
import tempfile
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

import checkpointd.storage
import checkpointd.storage.directio
import checkpointd.storage.local

_O_DIRECT: int = getattr(real_os, "O_DIRECT", 0)

IO_MODULES = (checkpointd.storage.local, checkpointd.storage.directio)
"""The modules whose ``os`` the wrapper replaces: every local system call of a save."""

MUTATING = (
    "create",
    "write",
    "write_direct",
    "fsync",
    "fsync_dir",
    "replace",
    "link",
    "unlink",
    "mkdir",
    "rmtree",
)


class SimulatedCrash(Exception):
    """The simulated process died at this call: nothing after it reaches the disk."""


@dataclass
class ErrnoRule:
    """Fail the ``nth`` matching call of ``op`` (whose path contains ``match``) with ``errno``."""

    op: str
    errno: int
    match: str = ""
    nth: int = 1
    times: int = 1
    seen: int = 0
    fired: int = 0


@dataclass
class _DirOp:
    folder: str
    undo: Callable[[], None]
    what: str


@dataclass
class FaultyOS:
    """A stand-in for ``os`` that logs, fails and crashes LocalStore's calls (thread-safe)."""

    crash_after: int | None = None
    rules: list[ErrnoRule] = field(default_factory=list)
    track_power: bool = False
    log: list[tuple[str, str]] = field(default_factory=list)
    crashed: bool = False
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _fd_paths: dict[int, str] = field(default_factory=dict)
    _synced_size: dict[int, int] = field(default_factory=dict)  # inode -> size at last fsync
    _dirty: dict[int, str] = field(default_factory=dict)  # inode -> a path it had
    _journal: list[_DirOp] = field(default_factory=list)
    _shadow_dir: str | None = None

    @property
    def _shadow(self) -> str:
        """Where removed files and trees are kept so a power loss can undo the removal."""
        with self._lock:
            if self._shadow_dir is None:
                self._shadow_dir = tempfile.mkdtemp(prefix="faultyos-")
                weakref.finalize(self, shutil.rmtree, self._shadow_dir, ignore_errors=True)
            return self._shadow_dir

    # -- bookkeeping --------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        return getattr(real_os, name)

    @property
    def count(self) -> int:
        """How many mutating calls were made so far."""
        return len(self.log)

    def _step(self, op: str, path: str) -> None:
        """Before a call: raise if dead, or if a rule fires for it."""
        if self.crashed:
            raise SimulatedCrash(f"{op} {path} after the crash")
        for rule in self.rules:
            if rule.op == op and rule.match in path and rule.fired < rule.times:
                rule.seen += 1
                if rule.seen >= rule.nth:
                    rule.fired += 1
                    self.log.append((f"{op}!", path))
                    raise OSError(rule.errno, real_os.strerror(rule.errno), path)

    def _done(self, op: str, path: str) -> None:
        """After a call succeeded: log it, and die if this was the crash point."""
        self.log.append((op, path))
        if self.crash_after is not None and len(self.log) >= self.crash_after:
            self.crashed = True

    def _guard(self) -> None:
        if self.crashed:
            raise SimulatedCrash("call after the crash")

    # -- calls LocalStore makes -------------------------------------------

    def open(self, path: str, flags: int, mode: int = 0o777, **kw: Any) -> int:
        with self._lock:
            creating = bool(flags & real_os.O_CREAT)
            if creating:
                self._step("create", path)
            else:
                self._guard()
            existed = real_os.path.lexists(path)
            fd = real_os.open(path, flags, mode, **kw)
            self._fd_paths[fd] = path
            if creating:
                if not existed:
                    ino = real_os.fstat(fd).st_ino
                    self._synced_size.setdefault(ino, 0)
                    self._dirty[ino] = path
                    self._record(path, f"create {path}", lambda: _remove_if(path, ino))
                self._done("create", path)
            return fd

    def write(self, fd: int, data: Any) -> int:
        with self._lock:
            path = self._fd_paths.get(fd, "?")
            # O_DIRECT bypasses the page cache, not the need for fsync: dirty all the same.
            direct = _O_DIRECT and fcntl.fcntl(fd, fcntl.F_GETFL) & _O_DIRECT
            op = "write_direct" if direct else "write"
            self._step(op, path)
            n = real_os.write(fd, data)
            self._dirty[real_os.fstat(fd).st_ino] = path
            self._done(op, path)
            return n

    def fsync(self, fd: int) -> None:
        with self._lock:
            path = self._fd_paths.get(fd, "?")
            info = real_os.fstat(fd)
            op = "fsync_dir" if stat.S_ISDIR(info.st_mode) else "fsync"
            self._step(op, path)
            real_os.fsync(fd)
            if op == "fsync_dir":
                folder = real_os.path.normpath(path)
                self._journal = [j for j in self._journal if j.folder != folder]
            else:
                self._synced_size[info.st_ino] = info.st_size
            self._done(op, path)

    def close(self, fd: int) -> None:
        with self._lock:
            self._fd_paths.pop(fd, None)
            real_os.close(fd)  # closing never writes: allowed even after the crash

    def replace(self, src: str, dst: str) -> None:
        with self._lock:
            self._step("replace", dst)
            backup = self._backup(dst)
            real_os.replace(src, dst)

            def undo() -> None:
                real_os.replace(dst, src)
                if backup is not None:
                    real_os.link(backup, dst)

            self._record(dst, f"replace {src} -> {dst}", undo)
            self._done("replace", dst)

    def link(self, src: str, dst: str, **kw: Any) -> None:
        with self._lock:
            self._step("link", dst)
            real_os.link(src, dst, **kw)
            self._record(dst, f"link {dst}", lambda: _remove_if(dst, None))
            self._done("link", dst)

    def unlink(self, path: str, **kw: Any) -> None:
        with self._lock:
            self._step("unlink", path)
            backup = self._backup(path)
            real_os.unlink(path, **kw)
            if backup is not None:
                self._record(path, f"unlink {path}", lambda: real_os.link(backup, path))
            self._done("unlink", path)

    def mkdir(self, path: str, mode: int = 0o777, **kw: Any) -> None:
        with self._lock:
            self._step("mkdir", path)
            real_os.mkdir(path, mode, **kw)
            self._record(path, f"mkdir {path}", lambda: shutil.rmtree(path, ignore_errors=True))
            self._done("mkdir", path)

    def rmtree(self, path: str, *args: Any, **kw: Any) -> None:
        with self._lock:
            self._step("rmtree", path)
            if not real_os.path.lexists(path):
                raise FileNotFoundError(2, "No such file or directory", path)
            # Moving it aside is what rmtree looks like from the root, and can be undone.
            aside = real_os.path.join(self._shadow, f"tree-{len(self.log)}")
            shutil.move(path, aside)
            self._record(path, f"rmtree {path}", lambda: shutil.move(aside, path))
            self._done("rmtree", path)

    def preadv(self, fd: int, buffers: Any, offset: int) -> int:
        self._guard()
        return real_os.preadv(fd, buffers, offset)

    def listdir(self, path: str) -> list[str]:
        self._guard()
        return real_os.listdir(path)

    def lstat(self, path: str, **kw: Any) -> Any:
        self._guard()
        return real_os.lstat(path, **kw)

    def fstat(self, fd: int) -> Any:
        self._guard()
        return real_os.fstat(fd)

    # -- power loss ---------------------------------------------------------

    def _backup(self, path: str) -> str | None:
        """Hard-link ``path`` aside (when tracking power) so its removal can be undone."""
        if not self.track_power or not real_os.path.lexists(path):
            return None
        aside = real_os.path.join(self._shadow, f"file-{len(self.log)}-{threading.get_ident()}")
        real_os.link(path, aside)
        return aside

    def _record(self, path: str, what: str, undo: Callable[[], None]) -> None:
        if self.track_power:
            folder = real_os.path.dirname(real_os.path.normpath(path))
            self._journal.append(_DirOp(folder, undo, what))

    def power_off(self) -> list[str]:
        """Apply a power loss now: drop unsynced bytes and unsynced folder changes.

        Returns what was undone, newest first. Call after the crash, before checking."""
        assert self.track_power, "construct with track_power=True"
        with self._lock:
            self.crashed = True
            for ino, path in self._dirty.items():
                synced = self._synced_size.get(ino, 0)
                for candidate in _paths_of(path):
                    if real_os.path.exists(candidate) and real_os.stat(candidate).st_ino == ino:
                        real_os.truncate(candidate, synced)
                        break
            undone = []
            for op in reversed(self._journal):
                op.undo()
                undone.append(op.what)
            self._journal.clear()
            return undone

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FaultyOS:
        """Route the os calls of LocalStore and of direct I/O, and LocalStore's
        shutil.rmtree, through this wrapper."""
        for module in IO_MODULES:
            monkeypatch.setattr(module, "os", self)
        monkeypatch.setattr(checkpointd.storage.local, "shutil", _ShutilProxy(self))
        return self

    def cleanup(self) -> None:
        """Remove the folder of things moved aside (the wrapper must not be used afterwards)."""
        if self._shadow_dir is not None:
            shutil.rmtree(self._shadow_dir, ignore_errors=True)


class _ShutilProxy:
    def __init__(self, faulty: FaultyOS) -> None:
        self._faulty = faulty

    def rmtree(self, path: str, *args: Any, **kw: Any) -> None:
        self._faulty.rmtree(path, *args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(shutil, name)


def _remove_if(path: str, ino: int | None) -> None:
    try:
        info = real_os.lstat(path)
    except FileNotFoundError:
        return
    if ino is None or info.st_ino == ino:
        real_os.unlink(path)


def _paths_of(path: str) -> list[str]:
    """Where inode ``ino`` may live now: where it was written, or where a rename put it."""
    candidates = [path]
    folder = real_os.path.dirname(path)
    if real_os.path.isdir(folder):
        candidates += [real_os.path.join(folder, n) for n in real_os.listdir(folder)]
    return candidates


def tree_files(root: str) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes), to prove nothing changed."""
    found: dict[str, bytes] = {}
    for folder, _, names in real_os.walk(root):
        for name in names:
            path = real_os.path.join(folder, name)
            with open(path, "rb") as handle:
                found[real_os.path.relpath(path, root)] = handle.read()
    return found


def temp_files(root: str) -> list[str]:
    """Every ``*.tmp-*`` file under ``root``."""
    return sorted(p for p in tree_files(root) if checkpointd.storage.TEMP_MARKER in p)
