"""Shard index files (schema 4): the manifest's rules for them, the reader's checks and
its box lookups (read/indexes.py), and the publisher's checks of posts that carry no
shard entries (write/ranked_merge.py)."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
import pytest

from checkpointd import tunables
from checkpointd.errors import CorruptCheckpointError, IncompatibleCheckpointError, RankFailedError
from checkpointd.format.checksum import crc32c
from checkpointd.format.manifest import (
    ComponentEntry,
    FileEntry,
    Manifest,
    ShardedTensor,
    ShardEntry,
    decode_manifest,
    encode_manifest,
    schema_for,
)
from checkpointd.format.shard_index import ShardIndex, encode_index, uses_indexes
from checkpointd.read.indexes import ShardIndexes
from checkpointd.write.plan import SavePlan
from checkpointd.write.ranked_merge import Share, indexed_share, merged_manifest

TREE = "m.t.tree.msgpack"


def shard(row: int, rows: int, rank: int) -> ShardEntry:
    return ShardEntry(f"m.t.rank{rank}.safetensors", [row, 0], [rows, 6], 64, 16, [0] * 12)


def index(rank: int, *shards: ShardEntry, step: int = 1, tensor: str = "w") -> bytes:
    return encode_index(ShardIndex(step, rank, {"m": {tensor: list(shards)}}))


def manifest(indexes: dict[int, bytes], *, schema: int | None = None) -> Manifest:
    """A 4-rank manifest of one sharded tensor [8, 6] whose shards are in ``indexes``."""
    files = [FileEntry(TREE, 10, 1)]
    files += [FileEntry(f"m.t.rank{r}.safetensors", 400, 2, r) for r in range(4)]
    names = {r: f"shards.t.rank{r}.json" for r in indexes}
    files += [FileEntry(names[r], len(data), crc32c(data), r) for r, data in indexes.items()]
    components = {"m": ComponentEntry(TREE, sharded={"w": ShardedTensor("float32", [8, 6], [])})}
    return Manifest(
        schema_version=schema or schema_for(components, indexed=bool(indexes)),
        step=1,
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
        library_version="0",
        components=components,
        files=sorted(files, key=lambda f: f.path),
        world_size=4,
        shard_indexes=[names[r] for r in sorted(indexes)],
    )


class Source:
    """The step's reader as ShardIndexes reads through it, with the index bytes in memory
    (``store.read_into_sized``), its digest check and its error for a vanished file."""

    def __init__(self, manifest: Manifest, data: dict[str, bytes]) -> None:
        self.where = "test"
        self.folder = "000000000001"
        self.manifest = manifest
        self.files = {f.path: f for f in manifest.files}
        self.data = data
        self.read: list[str] = []
        self.store = self

    def read_into_sized(self, path: str, buffer: memoryview, offset: int = 0) -> int:
        name = path.removeprefix(f"{self.folder}/")
        self.read.append(name)
        data = self.data[name]
        if len(buffer) <= len(data):
            buffer[:] = data[offset : offset + len(buffer)]
        return len(data)

    def check_digest(self, name: str, actual: int) -> None:
        if actual != self.files[name].crc32c:
            raise CorruptCheckpointError(f"{name}: CRC32C {actual:08x}")

    def vanished(self, name: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{name} is missing")


def quarters() -> dict[int, bytes]:
    return {r: index(r, shard(2 * r, 2, r)) for r in range(4)}


def reader(indexes: dict[int, bytes], *, stored: Manifest | None = None) -> Source:
    stored = manifest(indexes) if stored is None else stored
    return Source(stored, {f"shards.t.rank{r}.json": data for r, data in indexes.items()})


def test_the_writers_choose_indexes_by_ranks_times_sharded_tensors() -> None:
    limit = tunables.SHARD_INDEX_MIN_ENTRIES
    assert uses_indexes(8, limit // 8, limit)
    assert not uses_indexes(8, limit // 8 - 1, limit)
    assert not uses_indexes(1, 10**9, limit)  # a process saving alone lists its shards inline
    assert uses_indexes(2, 0, 0)


def test_a_manifest_with_indexes_is_schema_4_and_checked() -> None:
    stored = manifest(quarters())
    assert stored.schema_version == 4
    assert decode_manifest(encode_manifest(stored)) == stored
    unlisted = msgspec.structs.replace(stored, shard_indexes=[*stored.shard_indexes, "x.json"])
    with pytest.raises(CorruptCheckpointError, match="not a listed file"):
        decode_manifest(encode_manifest(unlisted))
    with pytest.raises(CorruptCheckpointError, match="schema_version 3"):
        decode_manifest(encode_manifest(manifest(quarters(), schema=3)))
    newer = encode_manifest(msgspec.structs.replace(stored, schema_version=5))
    with pytest.raises(IncompatibleCheckpointError, match="upgrade"):
        decode_manifest(newer)
    # without indexes, shards must still tile in the manifest itself (schema 2 rules)
    with pytest.raises(CorruptCheckpointError, match="elements"):
        decode_manifest(encode_manifest(manifest({}, schema=2)))


def test_a_whole_read_loads_every_index_and_checks_the_tiling() -> None:
    source = reader(quarters())
    stored = source.manifest.components["m"].sharded["w"]
    whole = ShardIndexes(source).sharded("m", "w", stored)
    assert [s.offsets[0] for s in whole.shards] == [0, 2, 4, 6]
    overlapping = {**quarters(), 3: index(3, shard(5, 2, 3))}  # rows 5-7: 5 twice, 7 never
    source = reader(overlapping)
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        ShardIndexes(source).sharded("m", "w", stored)
    gap = {r: data for r, data in quarters().items() if r != 2}
    with pytest.raises(CorruptCheckpointError, match="elements"):
        ShardIndexes(reader(gap)).sharded("m", "w", stored)


def test_a_box_read_loads_only_the_indexes_it_needs() -> None:
    source = reader(quarters())
    stored = source.manifest.components["m"].sharded["w"]
    indexes = ShardIndexes(source)
    got = indexes.sharded("m", "w", stored, ((4, 0), (2, 6)))
    assert [s.offsets for s in got.shards] == [[4, 0]]
    assert source.read == ["shards.t.rank2.json"]  # found by where the box starts
    got = indexes.sharded("m", "w", stored, ((3, 0), (2, 6)), near=[1])
    assert sorted(s.offsets[0] for s in got.shards) == [2, 4]
    assert source.read == ["shards.t.rank2.json", "shards.t.rank1.json"]
    # the hint leads: a box on the last rank, hinted at rank 3
    fresh = reader(quarters())
    ShardIndexes(fresh).sharded("m", "w", stored, ((6, 0), (2, 6)), near=[3])
    assert fresh.read == ["shards.t.rank3.json"]


def test_damaged_or_inconsistent_indexes_are_refused() -> None:
    stored = manifest(quarters()).components["m"].sharded["w"]
    cases = {
        "rank 0, not of step 1 rank 1": {**quarters(), 1: index(0, shard(2, 2, 1))},
        "another rank's file": {**quarters(), 1: index(1, shard(2, 2, 0))},
        "not a sharded tensor": {**quarters(), 1: index(1, shard(2, 2, 1), tensor="v")},
        "lies outside": {**quarters(), 1: index(1, shard(7, 2, 1))},
        "step 2": {**quarters(), 1: index(1, shard(2, 2, 1), step=2)},
    }
    for problem, indexes in cases.items():
        with pytest.raises(CorruptCheckpointError, match=problem):
            ShardIndexes(reader(indexes)).sharded("m", "w", stored)
    lost = {**quarters(), 2: index(2)}  # rank 2's index holds none of its rows
    with pytest.raises(CorruptCheckpointError, match="do not cover the box"):
        ShardIndexes(reader(lost)).sharded("m", "w", stored, ((4, 0), (2, 6)))
    damaged = reader(quarters())
    flipped = bytearray(damaged.data["shards.t.rank0.json"])
    flipped[len(flipped) // 2] ^= 1
    damaged.data["shards.t.rank0.json"] = bytes(flipped)
    damaged.data["shards.t.rank1.json"] = damaged.data["shards.t.rank1.json"][:-1]
    with pytest.raises(CorruptCheckpointError, match="CRC32C"):  # checked, verify or not
        ShardIndexes(damaged).sharded("m", "w", stored, ((0, 0), (2, 6)))
    with pytest.raises(CorruptCheckpointError, match="does not match the manifest's"):
        ShardIndexes(damaged).sharded("m", "w", stored, ((2, 0), (2, 6)))
    not_json = index(1, shard(2, 2, 1))[:-1] + b"!"  # a writer's bug: its own digest
    with pytest.raises(CorruptCheckpointError, match="not a shard index"):
        ShardIndexes(reader({**quarters(), 1: not_json})).sharded("m", "w", stored)


def plan(shape: list[int], name: str = "w") -> SavePlan:
    entry = ComponentEntry(TREE, sharded={name: ShardedTensor("float32", shape, [])})
    return SavePlan(1, [], {"m": entry}, datetime(2026, 1, 1, tzinfo=UTC), {}, {})


def posted(rank: int, *shards: ShardEntry, of: SavePlan) -> Share:
    """What a rank posts with indexes: its files (its index among them) and its checks."""
    files = [FileEntry(f"m.t.rank{rank}.safetensors", 400, 2, rank)]
    files.append(FileEntry(f"shards.t.rank{rank}.json", 100, 3, rank))
    share = Share(files, {}, {}, {"m": {"w": ShardedTensor("float32", [8, 6], list(shards))}})
    return indexed_share(share, of, f"shards.t.rank{rank}.json")


def test_the_publisher_merges_indexed_posts_and_checks_what_it_can() -> None:
    mine = plan([8, 6])
    shares = [posted(r, shard(2 * r, 2, r), of=mine) for r in range(4)]
    assert all(s.sharded == {} and s.elements == {"m": 12} for s in shares)
    merged = merged_manifest(mine, 4, shares, None)
    assert merged.schema_version == 4
    assert merged.shard_indexes == [f"shards.t.rank{r}.json" for r in range(4)]
    assert merged.components["m"].sharded["w"].shards == []
    short = [*shares[:3], posted(3, shard(6, 1, 3), of=mine)]
    with pytest.raises(RankFailedError, match="hold 42 elements, its DTensors 48"):
        merged_manifest(mine, 4, short, None)
    other = [*shares[:3], posted(3, shard(6, 2, 3), of=plan([8, 7]))]
    with pytest.raises(RankFailedError, match="disagree on the DTensors of component 'm'"):
        merged_manifest(mine, 4, other, None)
