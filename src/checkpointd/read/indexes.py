"""A step's shard index files (schema 4), loaded as a reader needs them.

A manifest with ``shard_indexes`` lists its sharded tensors' dtypes and shapes but
leaves (most of) their shard entries to one index file per rank that wrote shards
(format/shard_index.py). ``ShardIndexes.sharded`` gives a sharded tensor's entry with
the shards a box needs: for the whole tensor every index (read in parallel, once), the
shards checked to tile it; for a part (a restore's local box) the indexes one by one,
nearest the box's position first, until the shards read cover the box (checked: no two
overlap, their overlaps with the box add up to it). So a restore on the saving job's
layout reads about one index per rank, not all of them. Every index is checked against
its ``files`` entry (size, CRC32C) whether or not the reader verifies, then against the
manifest. Blocking; any thread (a lock guards the cache).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import threading
from typing import TYPE_CHECKING, Protocol

from checkpointd import tunables
from checkpointd.errors import CheckpointError, CorruptCheckpointError, StorageNotFoundError
from checkpointd.format.checksum import crc32c
from checkpointd.format.manifest import (
    ComponentEntry,
    FileEntry,
    Manifest,
    ShardedTensor,
    ShardEntry,
)
from checkpointd.format.manifest_checks import shard_problem
from checkpointd.format.shard_index import ShardIndex, decode_index

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping, Sequence

    from checkpointd.storage import Store

__all__ = ["ShardIndexes"]

Box = tuple[tuple[int, ...], tuple[int, ...]]


class IndexSource(Protocol):
    """What the indexes are read through: the step's reader (reader.StepReader), which
    makes the ShardIndexes, so this module does not import it back."""

    @property
    def where(self) -> str: ...

    @property
    def manifest(self) -> Manifest: ...

    @property
    def files(self) -> Mapping[str, FileEntry]: ...

    @property
    def store(self) -> Store: ...

    @property
    def folder(self) -> str: ...

    def check_digest(self, name: str, actual: int) -> None: ...

    def vanished(self, name: str) -> CheckpointError: ...


class ShardIndexes:
    """The shard indexes of one step: loaded on demand, kept once loaded."""

    def __init__(self, reader: IndexSource) -> None:
        self.reader = reader
        self.names = list(reader.manifest.shard_indexes)
        self._by_rank = {reader.files[n].rank: n for n in self.names}
        self._loaded: dict[str, ShardIndex] = {}
        self._lock = threading.Lock()
        self._components: dict[str, str] | None = None

    def component_of(self, entry: ComponentEntry) -> str:
        """The name of the manifest's component ``entry`` (by its tree file, one per
        component), under which the indexes hold its shards."""
        if self._components is None:
            self._components = {e.tree: n for n, e in self.reader.manifest.components.items()}
        return self._components.get(entry.tree, "")

    @property
    def loaded(self) -> int:
        """How many index files were read so far."""
        return len(self._loaded)

    def sharded(
        self,
        component: str,
        tensor: str,
        stored: ShardedTensor,
        box: Box | None = None,
        near: Sequence[int] = (),
    ) -> ShardedTensor:
        """``stored`` (the manifest's entry of ``component``/``tensor``) with the shards
        the indexes hold of it: all of them (``box`` None or the whole tensor, checked to
        tile it), or enough to cover ``box``, looking first at the indexes of ranks
        ``near`` (those that held this box when restoring onto the saving layout).
        CorruptCheckpointError if they do not."""
        if not self.names:
            return stored
        shape = tuple(stored.shape)
        if box is None or box == ((0,) * len(shape), shape):
            self._load(self.names)
            shards = list(stored.shards) + self._shards_of(self.names, component, tensor)
            whole = ShardedTensor(stored.dtype, stored.shape, shards)
            if problem := shard_problem(whole):
                raise CorruptCheckpointError(
                    f"{self.reader.where}: sharded tensor {component}/{tensor}: {problem}"
                )
            return whole
        shards = list(stored.shards)
        for name in self._nearest(shape, box, near):
            if _covers(shards, box):
                break
            self._load([name])
            shards += self._shards_of([name], component, tensor)
        if problem := _cover_problem(shards, box):
            raise CorruptCheckpointError(
                f"{self.reader.where}: sharded tensor {component}/{tensor}: {problem}"
            )
        return ShardedTensor(stored.dtype, stored.shape, shards)

    def problems(self) -> list[str]:
        """``verify``'s check, the one ``load`` makes: every index read and checked
        (``_read``), then every sharded tensor's shards, inline and indexed, checked to
        tile it (``sharded``); one line per refusal, nothing if none."""
        bad: list[str] = []
        for name in self.names:
            try:
                self._load([name])
            except CheckpointError as exc:
                bad.append(str(exc))
        if bad:
            return bad
        for component, entry in self.reader.manifest.components.items():
            for tensor, stored in entry.sharded.items():
                try:
                    self.sharded(component, tensor, stored)
                except CorruptCheckpointError as exc:
                    bad.append(str(exc))
        return bad

    def _nearest(self, shape: tuple[int, ...], box: Box, near: Sequence[int]) -> Iterator[str]:
        """The index names in the order to look, made as they are asked for (a lookup
        stops at the first few): the loaded ones (they cost nothing), those of ranks
        ``near``, then those nearest where ``box`` starts along the first dimension (the
        indexes are in rank order, and FSDP2 and HSDP shard the first dimension in rank
        order)."""
        with self._lock:
            loaded = list(self._loaded)
        hinted = (self._by_rank[r] for r in near if r in self._by_rank)
        count = len(self.names)
        guess = min(count - 1, box[0][0] * count // shape[0]) if shape and shape[0] else 0
        around = (
            self.names[i]
            for step in range(count)
            for i in ((guess,) if step == 0 else (guess + step, guess - step))
            if 0 <= i < count
        )
        seen: set[str] = set()
        for name in itertools.chain(loaded, hinted, around):
            if name not in seen:
                seen.add(name)
                yield name

    def _load(self, names: list[str]) -> None:
        """Read and check the indexes of ``names`` not loaded yet (in parallel)."""
        with self._lock:
            missing = [n for n in names if n not in self._loaded]
        if not missing:
            return
        if len(missing) == 1:
            loaded = [self._read(missing[0])]
        else:
            with concurrent.futures.ThreadPoolExecutor(tunables.READ_THREADS) as pool:
                loaded = list(pool.map(self._read, missing))
        with self._lock:
            self._loaded.update(zip(missing, loaded, strict=True))

    def _read(self, name: str) -> ShardIndex:
        """One index, checked against its file entry and the manifest."""
        where = f"{self.reader.where}/{name}"
        entry = self.reader.files[name]
        manifest = self.reader.manifest
        index = decode_index(self.read(name), step=manifest.step, rank=entry.rank, where=where)
        files = set(self.reader.files)
        blobs = {b.name for b in manifest.blobs}
        for component, tensors in index.components.items():
            entries = manifest.components.get(component)
            for tensor, shards in tensors.items():
                stored = None if entries is None else entries.sharded.get(tensor)
                if stored is None:
                    raise CorruptCheckpointError(
                        f"{where}: shards of {component}/{tensor}, not a sharded tensor of "
                        "the manifest"
                    )
                part = ShardedTensor(stored.dtype, stored.shape, shards)
                if problem := shard_problem(part, files, blobs, whole=False):
                    raise CorruptCheckpointError(f"{where}: {component}/{tensor}: {problem}")
                if any(s.file and self.reader.files[s.file].rank != entry.rank for s in shards):
                    raise CorruptCheckpointError(
                        f"{where}: {component}/{tensor} has a shard in another rank's file"
                    )
        return index

    def read(self, name: str) -> bytes:
        """Listed file ``name`` (an index) as bytes, its size and CRC32C checked against
        the manifest whether or not the reader verifies (an index is small)."""
        data = bytearray(self.reader.files[name].size)
        try:
            size = self.reader.store.read_into_sized(
                f"{self.reader.folder}/{name}", memoryview(data)
            )
        except StorageNotFoundError:
            raise self.reader.vanished(name) from None
        if size != len(data):
            raise CorruptCheckpointError(
                f"{self.reader.where}/{name}: size {size} does not match the manifest's {len(data)}"
            )
        self.reader.check_digest(name, crc32c(data))
        return bytes(data)

    def _shards_of(self, names: list[str], component: str, tensor: str) -> list[ShardEntry]:
        with self._lock:
            indexes = [self._loaded[n] for n in names]
        return [s for index in indexes for s in index.components.get(component, {}).get(tensor, [])]


def _parts(shards: list[ShardEntry], box: Box) -> list[Box]:
    """The non-empty overlaps of ``shards`` with ``box``."""
    parts = []
    for shard in shards:
        lo = [max(o, b) for o, b in zip(shard.offsets, box[0], strict=True)]
        hi = [
            min(o + n, b + m)
            for o, n, b, m in zip(shard.offsets, shard.shape, box[0], box[1], strict=True)
        ]
        if all(h > lo_ for lo_, h in zip(lo, hi, strict=True)):
            parts.append((tuple(lo), tuple(h - lo_ for lo_, h in zip(lo, hi, strict=True))))
    return parts


def _covers(shards: list[ShardEntry], box: Box) -> bool:
    """Whether the overlaps of ``shards`` with ``box`` add up to it (no overlap assumed)."""
    return sum(math.prod(p[1]) for p in _parts(shards, box)) == math.prod(box[1])


def _cover_problem(shards: list[ShardEntry], box: Box) -> str | None:
    """What is wrong with ``shards`` as the source of ``box``, or None: they must cover it
    and no two of the parts overlapping it may overlap each other."""
    parts = sorted(_parts(shards, box))
    for i, (a_at, a_shape) in enumerate(parts):
        for b_at, b_shape in parts[i + 1 :]:
            if b_at[0] >= a_at[0] + a_shape[0]:
                break  # sorted by the first offset: no later part reaches back into a
            if all(
                ao < bo + bn and bo < ao + an
                for ao, an, bo, bn in zip(a_at, a_shape, b_at, b_shape, strict=True)
            ):
                return f"shards at {list(a_at)} and {list(b_at)} overlap"
    if sum(math.prod(p[1]) for p in parts) != math.prod(box[1]):
        return f"the shards do not cover the box at {list(box[0])} of shape {list(box[1])}"
    return None
