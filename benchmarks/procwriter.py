"""A process-based writer prototype, to compare with the thread-based writer's cost to training.

The bytes live in POSIX shared memory; ``write_file`` writes them to a file
with direct I/O (as checkpointd's local store does for large files) and
fsyncs. ``ProcessWriter`` runs ``write_file`` in a child process
(``python -m benchmarks.procwriter NAME NBYTES``, paths on stdin, replies on
stdout); the training benchmark times training steps while it runs, against
the same function in a thread of the training process. This module imports
neither torch nor checkpointd, so the child starts in milliseconds.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import select
import subprocess
import sys
from multiprocessing.shared_memory import SharedMemory
from typing import IO

CHUNK = 16 * 2**20
ALIGN = 4096


def write_file(view: memoryview, path: str) -> None:
    """Write ``view`` (page-aligned, writable) to a new file at ``path``, then fsync.

    Whole 4 KiB blocks go out with O_DIRECT in 16 MiB chunks, the tail buffered.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        aligned = len(view) - len(view) % ALIGN
        direct = getattr(os, "O_DIRECT", 0)
        address = ctypes.addressof(ctypes.c_char.from_buffer(view)) if len(view) else 0
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        done = 0
        if direct and aligned and address % ALIGN == 0:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | direct)
            try:
                while done < aligned and (done % ALIGN) == 0:
                    done += os.write(fd, view[done : min(done + CHUNK, aligned)])
            finally:
                fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        rest = view[done:]
        while rest:
            rest = rest[os.write(fd, rest) :]
        os.fsync(fd)
    finally:
        os.close(fd)


class ProcessWriter:
    """A child process that writes the shared buffer to a path on request."""

    def __init__(self, shm: SharedMemory, nbytes: int) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.procwriter", shm.name, str(nbytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        self._stdin: IO[str] = self._proc.stdin  # type: ignore[assignment]
        self._stdout: IO[str] = self._proc.stdout  # type: ignore[assignment]
        self._pending = False

    def start(self, path: str) -> None:
        """Ask the child to write the buffer to ``path``; returns at once."""
        self._stdin.write(path + "\n")
        self._stdin.flush()
        self._pending = True

    def done(self) -> bool:
        """True once the last requested write is durable (never blocks)."""
        if self._pending and select.select([self._stdout], [], [], 0)[0]:
            self.wait()
        return not self._pending

    def wait(self) -> None:
        """Block until the last requested write is durable."""
        if self._pending:
            reply = self._stdout.readline().strip()
            self._pending = False
            if not reply.startswith("ok"):
                raise RuntimeError(f"process writer failed: {reply!r}")

    def close(self) -> None:
        """Let the child finish its last write and exit."""
        self._stdin.close()
        self._proc.wait(30)
        self._stdout.close()


def _serve(name: str, nbytes: int) -> None:
    # The parent owns (and unlinks) the segment; the child only attaches. Python
    # 3.11's resource tracker would unlink it when this process exits: opt out.
    shm = SharedMemory(name=name)
    from multiprocessing import resource_tracker

    # the tracker registered the segment under its private (slash-prefixed) name
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]  # noqa: SLF001
    view = shm.buf[:nbytes]
    try:
        for line in sys.stdin:
            try:
                write_file(view, line.strip())
                print("ok", flush=True)
            except OSError as exc:
                print(f"error {exc}", flush=True)
    finally:
        view.release()
        shm.close()


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))
