"""The memory tier: committed checkpoints the service keeps in shared memory, by root.

The service's side; the read-only Store a restoring client reads them through is
``memstore.py``.

The service keeps, per root, the newest ``keep`` steps it committed: the
segment the trainer captured into (no copy) plus each file's small head (tree
bytes, safetensors header) and CRC32C (held.py). A many-rank save's ranks on one
node each leave a copy of their share (``rank``), all counted as one step. A client
gets the segment read-only and reads it through ``client.memstore.MemoryStore`` under
``client.overlay.OverlayStore``, so restore's one reader of the format
(reader.StepReader) reads it with every check it makes on storage: sizes, CRC32Cs
against the manifest, headers. The client serves a file only where storage's
manifest lists the same path, size and CRC32C (client/recall.py). No torch here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from checkpointd.daemon.wire.protocol import HeldFile, ProtocolError
from checkpointd.daemon.wire.shm import MappedSegment
from checkpointd.storage import fixed_root, resolve_root
from checkpointd.storage.base import shown

__all__ = [
    "HeldCheckpoint",
    "MemoryTier",
    "RootKey",
    "root_key",
    "shown_key",
    "shown_root",
]


def shown_root(root: str, storage_options: Mapping[str, Any] | None) -> str:
    """``root`` as the service may print or log it: a URL's user and password
    (``user:pw@``) and query (a signed URL's token) masked, and the names of its storage options, never
    their values (credentials)."""
    root = shown(root)
    if not storage_options:
        return root
    return f"{root} (storage options: {', '.join(sorted(map(str, storage_options)))})"


def shown_key(key: str) -> str:
    """A root of a status reply as ``shown_root`` shows it, also from a service older
    than it, whose keys were the root, a space and its storage options' JSON."""
    at = key.find(" {")
    while at >= 0:
        try:
            options = msgspec.json.decode(key[at + 1 :])
        except msgspec.DecodeError:
            at = key.find(" {", at + 1)
            continue
        if isinstance(options, dict):
            return shown_root(key[:at], options)
        break
    return key


@dataclass(frozen=True, repr=False)
class RootKey:
    """A checkpoint root as the memory tier knows it (``root_key``). Its storage options
    may carry credentials: ``str`` and ``repr`` are ``shown_root``'s, without them."""

    name: str
    options: str
    """The storage options, as sorted JSON."""

    def __str__(self) -> str:
        return shown_root(self.name, msgspec.json.decode(self.options))

    __repr__ = __str__


def root_key(root: str, storage_options: Mapping[str, Any] | None) -> RootKey:
    """One name per checkpoint root, whichever way a client spells it: a local path
    with symlinks resolved, a URL without its trailing slash, with its storage options.
    ProtocolError for a root that names a different place in each process (a relative
    path, ``~``): a client resolves its roots before it sends them (resolve_root)."""
    if not fixed_root(root):
        raise ProtocolError(
            f"checkpoint root {root!r} is not absolute: it would name a folder under the "
            "service's working folder, not the client's (resolve it where it was given)"
        )
    name = resolve_root(root)
    if name.startswith("file://"):
        name = os.path.realpath(name.removeprefix("file://"))
    elif "://" not in name:
        name = os.path.realpath(name)
    options = msgspec.json.encode(storage_options or {}, order="sorted").decode()
    return RootKey(name, options)


@dataclass
class HeldCheckpoint:
    """One committed step held in memory: its segment, and its files, each with its
    CRC32C (held.py)."""

    step: int
    segment: MappedSegment
    files: list[HeldFile]
    rank: int | None = None
    """The saving rank whose share this is; None for a single-process save."""

    def supersedes(self, other: HeldCheckpoint) -> bool:
        """True if ``other`` (held before) is a copy of the same step that this one
        replaces: any of a single-process save, or the same rank's share."""
        return other.step == self.step and (
            self.rank is None or other.rank is None or other.rank == self.rank
        )

    @property
    def nbytes(self) -> int:
        return self.segment.capacity


@dataclass
class MemoryTier:
    """The held checkpoints, newest last per root. Used on the service's event loop."""

    keep: int
    """Steps held per root (the shares of one step that local ranks hold count once)."""
    release: Callable[[MappedSegment], None]
    """Frees a segment (and its bytes in the service's memory budget)."""
    roots: dict[RootKey, list[HeldCheckpoint]] = field(default_factory=dict)
    added: Callable[[RootKey, HeldCheckpoint], None] = lambda key, held: None
    """Called with each copy ``add`` keeps (the service sends a rank's share to its
    peers from there: server/replicas.py)."""

    def add(self, key: RootKey, held: HeldCheckpoint) -> None:
        """Hold ``held`` (just committed) for root ``key``; the copy it supersedes and the
        steps older than the newest ``keep`` go."""
        if self.keep <= 0:
            self.release(held.segment)
            return
        kept: list[HeldCheckpoint] = []
        for old in self.roots.get(key, []):
            if held.supersedes(old):
                self.release(old.segment)
            else:
                kept.append(old)
        kept.append(held)
        kept.sort(key=lambda h: h.step)
        while len({h.step for h in kept}) > self.keep:
            oldest = kept[0].step
            while kept and kept[0].step == oldest:
                self.release(kept.pop(0).segment)
        self.roots[key] = kept
        if any(h is held for h in kept):
            self.added(key, held)

    def find(self, key: RootKey, step: int, rank: int = 0) -> HeldCheckpoint | None:
        """The held copy of ``step``: ``rank``'s share where local ranks each hold one,
        else the first held."""
        found = [h for h in self.roots.get(key, []) if h.step == step]
        mine = [h for h in found if h.rank == rank]
        return (mine or found)[0] if found else None

    def evict_oldest(self) -> bool:
        """Free the oldest held checkpoint of any root; False if none is held."""
        candidates = [(h.step, key) for key, held in self.roots.items() for h in held[:1]]
        if not candidates:
            return False
        _, key = min(candidates)
        self.release(self.roots[key].pop(0).segment)
        if not self.roots[key]:
            del self.roots[key]
        return True

    def drop_root(self, key: RootKey) -> None:
        """Forget every held checkpoint of ``key`` (storage changed under it)."""
        for held in self.roots.pop(key, []):
            self.release(held.segment)

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for held in self.roots.values() for h in held)

    def steps(self) -> dict[str, list[int]]:
        """The steps held, by root as it may be shown (``RootKey``: no storage options'
        values; roots that differ only in those are shown as one)."""
        shown: dict[str, set[int]] = {}
        for key, held in self.roots.items():
            shown.setdefault(str(key), set()).update(h.step for h in held)
        return {name: sorted(steps) for name, steps in shown.items()}

    def clear(self) -> None:
        for key in list(self.roots):
            self.drop_root(key)
