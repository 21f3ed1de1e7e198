"""``restore(..., service=...)``: a restart on the same node reads from the memory tier.

The step to restore is decided by storage, as always: the newest committed step
(its manifest read from storage), or the one asked for. The service is asked
whether it holds that step; it is used only if the manifest it committed is
byte for byte the one on storage now (so a step replaced or re-committed by
someone else is never served from memory), and then read through
``MemoryStore`` by restore's own reader, which checks sizes and CRC32Cs against
that manifest before a byte is used. Anything else (no service, not held, a
mismatch, a damaged copy) falls back to storage. Imports torch (via restore).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from checkpointd.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ServiceError,
    StorageError,
)
from checkpointd.format.layout import MANIFEST_NAME, step_dirname
from checkpointd.read.restore import RestoreInfo, restore_from
from checkpointd.storage import open_store
from checkpointd.write.loop import newest_committed

from . import protocol as p
from .client import Connection, connect
from .memtier import MemoryStore
from .shm import map_fd

__all__ = ["restore_held"]


def restore_held(
    root: str,
    targets: Mapping[str, Any],
    step: int | None,
    *,
    storage_options: Mapping[str, Any] | None,
    strict: bool,
    service: str,
    place: tuple[int, int] = (0, 1),
) -> RestoreInfo | None:
    """Restore from the service's memory tier, or None where storage must be read;
    ``place`` as for ``restore_from``."""
    store = open_store(root, storage_options)
    try:
        found = newest_committed(store) if step is None else step
        if found is None:
            return None
        try:
            manifest = store.read_bytes(f"{step_dirname(found)}/{MANIFEST_NAME}")
        except StorageError:
            return None
    finally:
        store.close()
    try:
        conn = connect(service, start=False)
    except ServiceError:
        return None
    try:  # the service lends the segment until this connection ends: close it last
        return _from_held(
            conn,
            store.url,
            root,
            targets,
            found,
            manifest,
            storage_options=storage_options,
            strict=strict,
            place=place,
        )
    finally:
        conn.close()


def _from_held(  # noqa: PLR0917 - restore_held's own values, passed on
    conn: Connection,
    url: str,
    root: str,
    targets: Mapping[str, Any],
    found: int,
    manifest: bytes,
    *,
    storage_options: Mapping[str, Any] | None,
    strict: bool,
    place: tuple[int, int],
) -> RestoreInfo | None:
    """``restore_held`` once storage named the step: ask, map and restore it."""
    try:
        options = None if storage_options is None else dict(storage_options)
        reply, fd = conn.request(p.Lookup, root=root, storage_options=options, step=found)
    except ServiceError:
        return None
    if not isinstance(reply, p.Held) or fd is None:
        return None
    mapped = map_fd(fd, reply.size, writable=False, populate=False)
    try:
        if reply.manifest != manifest:
            return None  # storage's step is not the one the service committed
        held = MemoryStore.over(url, step_dirname(found), manifest, reply.files, mapped)
        try:
            return restore_from(held, targets, found, strict, source="memory", place=place)
        except (CorruptCheckpointError, CheckpointNotFoundError):
            return None  # a damaged or partial copy: storage decides
    finally:
        with contextlib.suppress(BufferError):
            mapped.close()
