"""The items a save plan lists (plan.py), a union tagged by ``kind``, and which rank
makes each one durable (``assign_ranks``):

- ``WriteFile`` (``"file"``): a file of the step folder whose bytes every rank
  holds alike (a replicated component's tree or tensor file; alone: every
  file). Ranks are assigned by size so each writes about as much.
- ``RankFile`` (``"rank-file"``): a file of the step folder only its rank holds:
  that rank's shards of a component's DTensors, or a file of its per-rank
  component. Never compared between ranks.
- ``WriteBlob`` (``"blob"``, incremental saves): a shared blob this save writes
  under ``blobs/``, since no earlier checkpoint stored its bytes.
- ``KeepBlob`` (``"kept-blob"``, incremental saves): a shared blob an earlier
  save stored, which the manifest references: nothing is written; the commit
  checks it is still stored before the publish (writing it again from ``parts``,
  the snapshot's copy, if it vanished and the snapshot holds one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar, Literal, TypeAlias

from checkpointd.format.checksum import BytesLike, crc32c, crc32c_combine
from checkpointd.format.manifest import BlobEntry

__all__ = [
    "KeepBlob",
    "PlannedFile",
    "RankFile",
    "WriteBlob",
    "WriteFile",
    "assign_ranks",
    "file_crc32c",
]


def _size(parts: Sequence[BytesLike]) -> int:
    return sum(memoryview(part).nbytes for part in parts)


@dataclass(frozen=True, slots=True)
class WriteFile:
    """A file of the step folder that every rank holds alike: ``parts`` concatenated,
    under ``name``; ``component`` is the one it belongs to, ``rank`` the rank that
    writes it (``assign_ranks``)."""

    kind: ClassVar[Literal["file"]] = "file"
    name: str
    parts: Sequence[BytesLike]
    component: str
    rank: int = 0
    crcs: Sequence[int | None] = ()
    """The CRC32C of each of ``parts`` where capture took it as it copied the bytes
    (None where not; empty: none): the writer combines it instead of reading the part."""

    @property
    def size(self) -> int:
        """Bytes the file will hold."""
        return _size(self.parts)


@dataclass(frozen=True, slots=True)
class RankFile:
    """A file of the step folder only ``rank`` holds (its shards, or its per-rank
    component's file): ``parts`` concatenated, under ``name``; written by that rank."""

    kind: ClassVar[Literal["rank-file"]] = "rank-file"
    name: str
    parts: Sequence[BytesLike]
    component: str
    rank: int = 0
    crcs: Sequence[int | None] = ()
    """The CRC32C of each of ``parts`` where capture took it as it copied the bytes
    (None where not; empty: none): the writer combines it instead of reading the part."""

    @property
    def size(self) -> int:
        """Bytes the file will hold."""
        return _size(self.parts)


@dataclass(frozen=True, slots=True)
class WriteBlob:
    """A shared blob this save writes: ``parts`` (the bytes whose XXH3-128 is ``name``)
    to ``blobs/NAME``, by ``rank``. ``own``: only ``rank`` holds these bytes (a shard);
    otherwise every rank holds them and ``assign_ranks`` picks the writer."""

    kind: ClassVar[Literal["blob"]] = "blob"
    name: str
    parts: Sequence[BytesLike]
    rank: int = 0
    own: bool = False

    @property
    def size(self) -> int:
        """Bytes the blob will hold."""
        return _size(self.parts)


@dataclass(frozen=True, slots=True)
class KeepBlob:
    """A shared blob an earlier save stored (``entry``) that the manifest references;
    ``rank`` checks it is still stored before the publish and, if it vanished, writes it
    again from ``parts`` (None: the snapshot holds no copy, so the save fails)."""

    kind: ClassVar[Literal["kept-blob"]] = "kept-blob"
    entry: BlobEntry
    parts: Sequence[BytesLike] | None
    rank: int = 0
    own: bool = False

    @property
    def name(self) -> str:
        """The blob's name."""
        return self.entry.name

    @property
    def size(self) -> int:
        """Bytes the blob holds (nothing is written unless it must be repaired)."""
        return self.entry.size


def file_crc32c(file: WriteFile | RankFile) -> int:
    """The CRC32C of ``file``'s bytes: of its parts in order, each read unless capture
    took its CRC32C (``crcs``). Any thread."""
    digest = 0
    for part, crc in zip(file.parts, file.crcs or [None] * len(file.parts), strict=True):
        view = memoryview(part).cast("B")
        digest = crc32c(view, digest) if crc is None else crc32c_combine(digest, crc, len(view))
    return digest


PlannedFile: TypeAlias = WriteFile | RankFile | WriteBlob | KeepBlob
"""One item a manifest will list, tagged by ``kind``; see the module docstring."""


def assign_ranks(files: list[PlannedFile], world_size: int) -> list[PlannedFile]:
    """``files`` with the rank that makes each one durable: a ``RankFile`` and an own
    blob keep theirs; the items every rank holds alike (``WriteFile``, and blobs not
    ``own``) go largest first to the least-loaded rank (lowest rank on ties), so every
    rank writes about the same number of bytes, the same on every rank. Kept blobs
    weigh nothing (nothing is written) and go round-robin."""
    loads = [0] * world_size
    ranked: dict[int, PlannedFile] = {}
    shared: list[tuple[int, WriteFile | WriteBlob]] = []
    kept: list[tuple[int, KeepBlob]] = []
    for index, file in enumerate(files):
        if isinstance(file, WriteFile) or (isinstance(file, WriteBlob) and not file.own):
            shared.append((index, file))
        elif isinstance(file, KeepBlob) and not file.own:
            kept.append((index, file))
        else:
            ranked[index] = file
    for index, file in sorted(shared, key=lambda f: (-f[1].size, f[1].kind, f[1].name)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        loads[rank] += file.size
        ranked[index] = replace(file, rank=rank)
    for turn, (index, blob) in enumerate(sorted(kept, key=lambda f: f[1].name)):
        ranked[index] = replace(blob, rank=turn % world_size)
    return [ranked[index] for index in range(len(files))]
