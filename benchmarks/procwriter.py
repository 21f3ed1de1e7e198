"""A process-based writer prototype, to compare with the thread-based writer's cost to training.

The bytes live in POSIX shared memory; ``write_file`` writes them to a file
(direct I/O where aligned, like checkpointd's local store) and fsyncs. A
``ProcessWriter`` runs ``write_file`` in a child process; the training
benchmark times training steps while it runs, against the same function in a
thread of the training process.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory

from checkpointd.directio import write_direct

CHUNK = 16 * 2**20


def write_file(view: memoryview, path: str) -> None:
    """Write ``view`` to a new file at ``path`` in 16 MiB chunks, then fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for start in range(0, len(view), CHUNK):
            rest, _ = write_direct(fd, view[start : start + CHUNK])
            while rest:
                rest = rest[os.write(fd, rest) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _serve(name: str, nbytes: int, conn: Connection) -> None:
    shm = SharedMemory(name=name)
    try:
        view = shm.buf[:nbytes]
        while (path := conn.recv()) is not None:
            write_file(view, path)
            conn.send(path)
        view.release()
    finally:
        shm.close()


class ProcessWriter:
    """A child process that writes the shared buffer to a path on request."""

    def __init__(self, shm: SharedMemory, nbytes: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(shm.name, nbytes, child), daemon=True)
        self._proc.start()

    def start(self, path: str) -> None:
        """Ask the child to write the buffer to ``path``; returns at once."""
        self._conn.send(path)

    def done(self) -> bool:
        """True once the last requested write is durable."""
        if self._conn.poll():
            self._conn.recv()
            return True
        return False

    def close(self) -> None:
        self._conn.send(None)
        self._proc.join(30)
