"""``restore(..., service=...)``: a restart on the same node reads from the memory tier.

The step to restore is decided by storage, as always: the newest committed step
(its manifest read from storage), or the one asked for. The service is asked
whether it holds that step (a single process's save, or this rank's share of a
many-rank one: server/held.py), and what it holds is served file by file, only
where storage's manifest lists the held file's path, size and CRC32C
(``servable``): the restore reads those from memory and every other file from
storage (``OverlayStore``), so a step replaced or re-committed by someone else is
served from memory only where its bytes are the held ones.

Restore's own reader checks sizes and every byte's CRC32C against
storage's manifest before a byte is used. Anything else (no service, not held, a
mismatch, a damaged copy) falls back to storage. This module only finds the held
copy; read/restore.py restores from it (so it does not import restore back).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from checkpointd.daemon.client.client import Connection, connect
from checkpointd.daemon.client.memstore import MemoryStore
from checkpointd.daemon.client.overlay import OverlayStore
from checkpointd.daemon.wire import protocol as p
from checkpointd.daemon.wire.shm import map_fd
from checkpointd.errors import CheckpointError, ServiceError, StorageError
from checkpointd.format.layout import MANIFEST_NAME, step_dirname
from checkpointd.format.manifest import Manifest, decode_manifest
from checkpointd.storage import Store, open_store, resolve_root
from checkpointd.write.loop import newest_committed

__all__ = ["Recalled", "held_copy", "servable"]


@dataclass(frozen=True)
class Recalled:
    """A held copy to restore ``step`` from: read it through ``store`` (closing it
    closes no storage: held_copy does); ``source()`` once read says what was used
    ("memory", "memory+storage" or "storage", "peer" for "memory" where the copy came
    from another node's service: ``RestoreInfo.source``)."""

    store: Store
    step: int
    source: Callable[[], str]


def servable(manifest: Manifest, files: list[p.HeldFile]) -> list[p.HeldFile]:
    """The held files that storage's ``manifest`` lists with the same path, size and
    CRC32C (the others are read from storage)."""
    listed = {(f.path, f.size, f.crc32c) for f in manifest.files}
    return [f for f in files if (f.path, len(f.head) + f.length, f.crc32c) in listed]


@contextlib.contextmanager
def held_copy(
    root: str,
    step: int | None,
    *,
    storage_options: Mapping[str, Any] | None,
    service: str,
    rank: int = 0,
) -> Iterator[Recalled | None]:
    """The service's in-memory copy of the step to restore (the newest committed one on
    storage, or ``step``), or None where storage must be read. ``rank``: this process's
    in the group that restores (its own share is asked for first). The service lends
    the copy until the block ends; then it is unmapped and storage closed. ``root`` is
    resolved here (the service refuses a relative one)."""
    root = resolve_root(root)
    store = open_store(root, storage_options)
    try:
        found = newest_committed(store) if step is None else step
        manifest = None
        if found is not None:
            with contextlib.suppress(StorageError):
                manifest = store.read_bytes(f"{step_dirname(found)}/{MANIFEST_NAME}")
        if found is None or manifest is None:
            yield None
            return
        try:
            conn = connect(service, start=False)
        except ServiceError:
            yield None
            return
        try:  # the service lends the segment until this connection ends: close it last
            ask = _Ask(root, storage_options, found, manifest, rank)
            with _lent(conn, store, ask) as held:
                yield held
        finally:
            conn.close()
    finally:
        store.close()


@dataclass(frozen=True)
class _Ask:
    """What held_copy asks the service for, and storage's manifest of it."""

    root: str
    storage_options: Mapping[str, Any] | None
    step: int
    manifest: bytes
    rank: int


@contextlib.contextmanager
def _lent(conn: Connection, storage: Store, ask: _Ask) -> Iterator[Recalled | None]:
    """``held_copy`` once storage named the step: ask for it and map it read-only."""
    try:
        options = None if ask.storage_options is None else dict(ask.storage_options)
        reply, fd = conn.request(
            p.Lookup, root=ask.root, storage_options=options, step=ask.step, rank=ask.rank
        )
    except ServiceError:
        yield None
        return
    if not isinstance(reply, p.Held) or fd is None:
        yield None
        return
    mapped = map_fd(fd, reply.size, writable=False, populate=False)
    folder = step_dirname(ask.step)
    try:
        try:
            listed = decode_manifest(ask.manifest, where=f"{storage.url}/{folder}")
        except CheckpointError:
            listed = None  # restore from storage reports it
        files = [] if listed is None else servable(listed, reply.files)
        if not files:
            yield None
        else:
            held = MemoryStore.over(storage.url, folder, ask.manifest, files, mapped)
            overlay = OverlayStore(storage, held)
            kind = reply.source  # "memory", or "peer": a copy another node's service sent
            yield Recalled(overlay, ask.step, lambda: overlay.source.replace("memory", kind))
    finally:
        with contextlib.suppress(BufferError):
            mapped.close()
