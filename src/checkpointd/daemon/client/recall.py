"""``restore(..., service=...)``: a restart on the same node reads from the memory tier.

The step to restore is decided by storage, as always: the newest committed step
(its manifest read from storage), or the one asked for. The service is asked
whether it holds that step (a single process's save, or this rank's share of a
many-rank one: server/held.py), and what it holds is served file by file, only
where storage's manifest lists the held file's path, size and CRC32C
(``servable``): the restore reads those from memory and every other file from
storage (``OverlayStore``), so a step replaced or re-committed by someone else is
served from memory only where its bytes are the held ones. A file this rank's share
does not hold (another saved rank's, when the job reshards) is looked up as the
restore first reads it: the share of the rank storage's manifest says wrote it, from
this node's memory, else from a peer of the job that holds it (the service fetches
it), else storage; a share is asked for once, and only if a file of it is read.

Restore's own reader checks sizes and every byte's CRC32C against
storage's manifest before a byte is used. Anything else (no service, not held, a
mismatch, a damaged copy) falls back to storage. This module only finds the held
copy; read/restore.py restores from it (so it does not import restore back).
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from checkpointd.daemon.client.client import Connection, connect
from checkpointd.daemon.client.memstore import MemoryStore
from checkpointd.daemon.client.overlay import Copy, OverlayStore
from checkpointd.daemon.wire import protocol as p
from checkpointd.daemon.wire.shm import map_fd
from checkpointd.errors import CheckpointError, ServiceError, StorageError
from checkpointd.format.layout import MANIFEST_NAME, is_rank_file, step_dirname
from checkpointd.format.manifest import Manifest, decode_manifest
from checkpointd.storage import Store, open_store, resolve_root
from checkpointd.write.loop import newest_committed

__all__ = ["Recalled", "held_copy", "servable"]


@dataclass(frozen=True)
class Recalled:
    """A held copy to restore ``step`` from: read it through ``store`` (closing it
    closes no storage: held_copy does); ``source()`` once read says what was used
    (``OverlayStore.source``: "memory", "peer" where a copy came from another node's
    service, "storage", or several joined by "+": ``RestoreInfo.source``)."""

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
    """``held_copy`` once storage named the step: ask for it and map it read-only; the
    other saved ranks' shares are asked for as the restore reads their files."""
    folder = step_dirname(ask.step)
    try:
        listed = decode_manifest(ask.manifest, where=f"{storage.url}/{folder}")
    except CheckpointError:
        yield None  # restore from storage reports it
        return
    shares = _Shares(conn, storage.url, ask, listed)
    try:
        first = shares.lookup(ask.rank, exact=False)
        if first is None and len({f.rank for f in listed.files}) <= 1:
            yield None  # one rank's save, not held: storage
            return
        if first is None:  # other saved ranks' shares may still be held
            first = (MemoryStore(storage.url, {}), "memory")
        overlay = OverlayStore(storage, *first, more=shares.more)
        yield Recalled(overlay, ask.step, lambda: overlay.source)
    finally:
        shares.close()


class _Shares:
    """The held shares of one step a restoring rank has been lent (each mapped until
    ``close``), and which saved rank's share holds which file: a file of one rank's own
    (its shards, shard index, per-rank components) that no share lent so far serves is
    looked up once, in the share of the rank storage's manifest says wrote it. A file
    every rank holds alike (a tree, a replicated tensor) is served by the shares already
    lent, else storage: never a whole share fetched for it. Under OverlayStore's lock."""

    def __init__(self, conn: Connection, url: str, ask: _Ask, listed: Manifest) -> None:
        self._conn = conn
        self._url = url
        self._ask = ask
        self._listed = listed
        self._folder = step_dirname(ask.step)
        self._rank_of = {
            f"{self._folder}/{f.path}": f.rank for f in listed.files if is_rank_file(f.path, f.rank)
        }
        self._asked: set[int] = set()
        self._mapped: list[mmap.mmap] = []

    def lookup(self, rank: int, *, exact: bool) -> Copy | None:
        """Saved rank ``rank``'s share (``exact``; else the node's copy for that rank, as
        ``Lookup`` says) from this node's memory, or a peer's through it, with the files
        storage's manifest lists alike; None if not held (or none such)."""
        ask = self._ask
        options = None if ask.storage_options is None else dict(ask.storage_options)
        try:
            reply, fd = self._conn.request(
                p.Lookup,
                root=ask.root,
                storage_options=options,
                step=ask.step,
                rank=rank,
                exact=exact,
            )
        except ServiceError:
            return None
        if exact or not isinstance(reply, p.Held):
            self._asked.add(rank)
        if not isinstance(reply, p.Held) or fd is None:
            return None
        mapped = map_fd(fd, reply.size, writable=False, populate=False)
        self._mapped.append(mapped)
        if reply.rank is not None:
            self._asked.add(reply.rank)
        files = servable(self._listed, reply.files)
        if not files:
            return None
        memory = MemoryStore.over(self._url, self._folder, ask.manifest, files, mapped)
        return memory, reply.source  # "memory", or "peer": another node's service's copy

    def more(self, path: str) -> Copy | None:
        """The share of the saved rank that wrote ``path``, if not asked for yet."""
        rank = self._rank_of.get(path)
        if rank is None or rank in self._asked:
            return None
        return self.lookup(rank, exact=True)

    def close(self) -> None:
        """Unmap every share (the service lends them until the connection ends)."""
        for mapped in self._mapped:
            with contextlib.suppress(BufferError):
                mapped.close()
