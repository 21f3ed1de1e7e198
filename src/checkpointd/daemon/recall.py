"""``restore(..., service=...)``: a restart on the same node reads from the memory tier.

The step to restore is decided by storage, as always: the newest committed step
(its manifest read from storage), or the one asked for. The service is asked
whether it holds that step; it is used only if the manifest it committed is
byte for byte the one on storage now (so a step replaced or re-committed by
someone else is never served from memory), and then read through
``MemoryStore`` by restore's own reader, which checks sizes and CRC32Cs against
that manifest before a byte is used. Anything else (no service, not held, a
mismatch, a damaged copy) falls back to storage. This module only finds the held
copy; read/restore.py restores from it (so it does not import restore back).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from checkpointd.errors import ServiceError, StorageError
from checkpointd.format.layout import MANIFEST_NAME, step_dirname
from checkpointd.storage import Store, open_store
from checkpointd.write.loop import newest_committed

from . import protocol as p
from .client import Connection, connect
from .memtier import MemoryStore
from .shm import map_fd

__all__ = ["held_copy"]


@contextlib.contextmanager
def held_copy(
    root: str,
    step: int | None,
    *,
    storage_options: Mapping[str, Any] | None,
    service: str,
) -> Iterator[tuple[Store, int] | None]:
    """The service's in-memory copy of the step to restore (the newest committed one on
    storage, or ``step``) as a read-only store and that step, or None where storage
    must be read. The service lends the copy until the block ends; then it is unmapped."""
    store = open_store(root, storage_options)
    try:
        found = newest_committed(store) if step is None else step
        manifest = None
        if found is not None:
            with contextlib.suppress(StorageError):
                manifest = store.read_bytes(f"{step_dirname(found)}/{MANIFEST_NAME}")
    finally:
        store.close()
    if found is None or manifest is None:
        yield None
        return
    try:
        conn = connect(service, start=False)
    except ServiceError:
        yield None
        return
    try:  # the service lends the segment until this connection ends: close it last
        with _lent(conn, store.url, root, found, manifest, storage_options) as held:
            yield held
    finally:
        conn.close()


@contextlib.contextmanager
def _lent(  # noqa: PLR0917 - held_copy's own values, passed on
    conn: Connection,
    url: str,
    root: str,
    found: int,
    manifest: bytes,
    storage_options: Mapping[str, Any] | None,
) -> Iterator[tuple[Store, int] | None]:
    """``held_copy`` once storage named the step: ask for it and map it read-only."""
    try:
        options = None if storage_options is None else dict(storage_options)
        reply, fd = conn.request(p.Lookup, root=root, storage_options=options, step=found)
    except ServiceError:
        yield None
        return
    if not isinstance(reply, p.Held) or fd is None:
        yield None
        return
    mapped = map_fd(fd, reply.size, writable=False, populate=False)
    try:
        if reply.manifest != manifest:
            yield None  # storage's step is not the one the service committed
        else:
            yield MemoryStore.over(url, step_dirname(found), manifest, reply.files, mapped), found
    finally:
        with contextlib.suppress(BufferError):
            mapped.close()
