"""A read-only Store that serves the files a rank's service holds from memory and every
other file from storage: what a rank of a many-rank job restores through.

Each rank's service holds only its share of a many-rank save (held.py): its own
shards, the replicated files. A restore reads those from the held copy
(``MemoryStore``, whose manifest is the one the client read from storage) and the
rest (other ranks' shards when resharding, anything not held or that storage's
manifest disagrees on) from storage, through restore's one reader, which checks
every byte's CRC32C against that manifest either way. ``source`` says what was
read. Any thread. No torch here.
"""

from __future__ import annotations

from checkpointd.daemon.client.memstore import MemoryStore, ReadOnlyStore
from checkpointd.format.layout import MANIFEST_NAME
from checkpointd.storage import Store
from checkpointd.storage.base import PinnedFile

__all__ = ["MIXED_SOURCE", "OverlayStore"]

MIXED_SOURCE = "memory+storage"
"""``RestoreInfo.source`` of a restore that read some files from the memory tier and
some from storage."""


class OverlayStore(ReadOnlyStore):
    """``memory``'s files over ``storage``: reads only. Closing it closes neither (their
    owner, recall.held_copy, does)."""

    def __init__(self, storage: Store, memory: MemoryStore) -> None:
        self.url = storage.url
        self._storage = storage
        self._memory = memory
        self._from_memory: set[str] = set()
        self._from_storage: set[str] = set()

    @property
    def source(self) -> str:
        """What the files read so far came from: "memory" (all of them), "storage" (none
        from memory) or ``MIXED_SOURCE``. The manifest does not count (the client read it
        from storage before, and the held copy serves those very bytes)."""
        if not self._from_memory:
            return "storage"
        return MIXED_SOURCE if self._from_storage else "memory"

    def _pick(self, path: str) -> Store:
        """The store that serves ``path``, noted as read from there."""
        if self._memory.holds(path):
            if not path.endswith(f"/{MANIFEST_NAME}"):
                self._from_memory.add(path)
            return self._memory
        self._from_storage.add(path)
        return self._storage

    def size(self, path: str) -> int:
        store = self._memory if self._memory.holds(path) else self._storage
        return store.size(path)

    def read_into(self, path: str, buffer: memoryview, offset: int = 0) -> None:
        self._pick(path).read_into(path, buffer, offset)

    def read_into_sized(self, path: str, buffer: memoryview, offset: int = 0) -> int:
        return self._pick(path).read_into_sized(path, buffer, offset)

    def open_pinned(self, path: str) -> PinnedFile | None:
        return self._pick(path).open_pinned(path)

    def list_dir(self, path: str) -> list[str]:
        return sorted({*self._storage.list_dir(path), *self._memory.list_dir(path)})
