"""A read-only Store that serves the files held copies hold from memory and every other
file from storage: what a rank of a many-rank job restores through.

Each rank's service holds only its share of a many-rank save (held.py): its own
shards, the replicated files. A restore reads those from the held copy
(``MemoryStore``, whose manifest is the one the client read from storage), then, file
by file, from further held copies a ``more`` callback finds as the reader asks for
them (another saved rank's share when resharding: recall.py looks it up in the node's
memory or fetches it from a peer), and the rest (anything not held, or that storage's
manifest disagrees on) from storage, through restore's one reader, which checks every
byte's CRC32C against that manifest either way. ``source`` says what was read. Any
thread. No torch here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from checkpointd.daemon.client.memstore import MemoryStore, ReadOnlyStore
from checkpointd.format.layout import MANIFEST_NAME
from checkpointd.storage import Store
from checkpointd.storage.base import PinnedFile

__all__ = ["MIXED_SOURCE", "Copy", "OverlayStore"]

MIXED_SOURCE = "memory+storage"
"""``RestoreInfo.source`` of a restore that read some files from the memory tier and
some from storage."""

_KINDS = ("memory", "peer", "storage")
"""Where a file's bytes came from, in the order ``source`` names them."""

Copy = tuple[MemoryStore, str]
"""A held copy and where it came from: "memory" (this node's own) or "peer"."""


class OverlayStore(ReadOnlyStore):
    """Held copies over ``storage``: reads only. ``memory`` (``kind``) first, then each
    copy ``more(path)`` finds for a path none holds yet (None: storage serves it; it is
    called once per path, under a lock). Closing it closes none of them (their owner,
    recall.held_copy, does)."""

    def __init__(
        self,
        storage: Store,
        memory: MemoryStore,
        kind: str = "memory",
        more: Callable[[str], Copy | None] | None = None,
    ) -> None:
        self.url = storage.url
        self._storage = storage
        self._copies: list[Copy] = [(memory, kind)]
        self._more = more
        self._asked: set[str] = set()
        self._lock = threading.Lock()
        self._read: dict[str, set[str]] = {kind: set() for kind in _KINDS}

    @property
    def source(self) -> str:
        """What the files read so far came from: "memory" or "peer" (all of them from
        one), "storage" (none from memory), or those used joined by "+" in that order
        (``MIXED_SOURCE``, "memory+peer", "peer+storage"...). The manifest does not count
        (the client read it from storage before; a held copy serves those very bytes)."""
        used = [kind for kind in _KINDS if self._read[kind]]
        if used in ([], ["storage"]):
            return "storage"
        return "+".join(used)

    def _copy(self, path: str) -> Copy | None:
        """The held copy that serves ``path``, if any (found by ``more`` if need be)."""
        for copy in self._copies:
            if copy[0].holds(path):
                return copy
        if self._more is None:
            return None
        with self._lock:
            for copy in self._copies:  # another thread may have found it meanwhile
                if copy[0].holds(path):
                    return copy
            if path in self._asked:
                return None
            self._asked.add(path)
            found = self._more(path)
            if found is not None:
                self._copies.append(found)
                if found[0].holds(path):
                    return found
        return None

    def _pick(self, path: str) -> Store:
        """The store that serves ``path``, noted as read from there."""
        copy = self._copy(path)
        if not path.endswith(f"/{MANIFEST_NAME}"):
            self._read["storage" if copy is None else copy[1]].add(path)
        return self._storage if copy is None else copy[0]

    def size(self, path: str) -> int:
        copy = self._copy(path)
        return (self._storage if copy is None else copy[0]).size(path)

    def read_into(self, path: str, buffer: memoryview, offset: int = 0) -> None:
        self._pick(path).read_into(path, buffer, offset)

    def read_into_sized(self, path: str, buffer: memoryview, offset: int = 0) -> int:
        return self._pick(path).read_into_sized(path, buffer, offset)

    def open_pinned(self, path: str) -> PinnedFile | None:
        return self._pick(path).open_pinned(path)

    def list_dir(self, path: str) -> list[str]:
        names = set(self._storage.list_dir(path))
        for memory, _ in list(self._copies):
            names.update(memory.list_dir(path))
        return sorted(names)
