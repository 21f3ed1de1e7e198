"""The commit lease: one writer at a time may commit files into a step folder.

A writer claims a step by creating ``writer.lock`` in its folder exclusively,
after its files are fully written but before any is committed under its final
name, and removes it after the manifest is published. A second writer finds the
lock and fails with CheckpointExistsError without touching anything. A lock is
stale (its writer crashed inside the short commit phase) when its process is
gone on this host, or when it is older than ``LEASE_SECONDS``; a stale lock is
taken over. Blocking; called from worker threads.
"""

from __future__ import annotations

import os
import secrets
import socket
import time

import msgspec

from checkpointd.errors import CheckpointExistsError, StorageNotFoundError
from checkpointd.storage import Store

__all__ = ["LEASE_NAME", "LEASE_SECONDS", "Lease", "claim", "is_stale"]

LEASE_NAME = "writer.lock"
LEASE_SECONDS = 600.0


class Lease(msgspec.Struct, frozen=True):
    """Who holds a step's commit lease, and since when (Unix seconds)."""

    host: str
    pid: int
    token: str
    acquired_at: float


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_stale(lease: Lease, *, now: float | None = None) -> bool:
    """True if the lease's writer is known dead, or the lease outlived LEASE_SECONDS."""
    now = time.time() if now is None else now
    if now - lease.acquired_at > LEASE_SECONDS:
        return True
    return lease.host == socket.gethostname() and not _pid_alive(lease.pid)


def read_lease(store: Store, folder: str) -> Lease | None:
    """The lease in ``folder``, or None if there is none or it is unreadable."""
    try:
        data = store.read_bytes(f"{folder}/{LEASE_NAME}")
        return msgspec.json.decode(data, type=Lease)
    except (StorageNotFoundError, msgspec.DecodeError):
        return None


def claim(store: Store, folder: str) -> Lease:
    """Take the commit lease of ``folder``; raise CheckpointExistsError if a live writer holds it."""
    lease = Lease(socket.gethostname(), os.getpid(), secrets.token_hex(8), time.time())
    path = f"{folder}/{LEASE_NAME}"
    for _ in range(2):
        try:
            store.publish(path, msgspec.json.encode(lease))
            return lease
        except CheckpointExistsError:
            holder = read_lease(store, folder)
            if holder is not None and not is_stale(holder):
                raise CheckpointExistsError(
                    f"{store.url}/{folder} is being committed by another writer "
                    f"(pid {holder.pid} on {holder.host})"
                ) from None
            store.remove_file(path)
    raise CheckpointExistsError(f"{store.url}/{folder}: could not take the commit lease")


def release(store: Store, folder: str, lease: Lease) -> None:
    """Drop ``lease`` if it is still ours (a stale-lease takeover may have replaced it)."""
    holder = read_lease(store, folder)
    if holder is not None and holder.token == lease.token:
        store.remove_file(f"{folder}/{LEASE_NAME}")
