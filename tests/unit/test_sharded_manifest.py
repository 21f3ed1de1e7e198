"""Sharded tensors in the manifest: the tiling rule, schema 2 only where needed, and
shard reads that check every block they touch."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
import pytest

from checkpointd.errors import CorruptCheckpointError
from checkpointd.format.manifest import (
    ComponentEntry,
    FileEntry,
    Manifest,
    ShardedTensor,
    ShardEntry,
    decode_manifest,
    encode_manifest,
    schema_for,
    shard_problem,
)
from checkpointd.state.shards import intersect


def shard(offsets: list[int], shape: list[int], file: str = "m.t.rank0.safetensors") -> ShardEntry:
    return ShardEntry(file, offsets, shape, begin=64, block_bytes=16, crc32c=[0] * 8)


def tensor(*shards: ShardEntry) -> ShardedTensor:
    return ShardedTensor("float32", [4, 6], list(shards))


def test_shards_that_tile_the_tensor_are_accepted() -> None:
    assert shard_problem(tensor(shard([0, 0], [2, 6]), shard([2, 0], [2, 6]))) is None
    quarters = [shard([r, c], [2, 3]) for r in (0, 2) for c in (0, 3)]
    assert shard_problem(tensor(*quarters)) is None
    # an empty shard (a rank beyond an uneven split) takes no room
    assert shard_problem(tensor(shard([0, 0], [4, 6]), shard([4, 0], [0, 6]))) is None


@pytest.mark.parametrize(
    ("shards", "problem"),
    [
        ([shard([0, 0], [2, 6])], "shards hold 12 elements, the tensor 24"),
        ([shard([0, 0], [3, 6]), shard([3, 0], [2, 6])], "lies outside"),
        ([shard([0, 0], [3, 6]), shard([1, 0], [1, 6]), shard([4, 0], [0, 6])], "overlap"),
        ([shard([0, 0], [2, 3]), shard([0, 2], [2, 3]), shard([2, 0], [2, 6])], "overlap"),
        ([shard([0], [4])], "another rank"),
    ],
)
def test_shards_that_do_not_tile_are_refused(shards: list[ShardEntry], problem: str) -> None:
    found = shard_problem(tensor(*shards))
    assert found is not None
    assert problem in found


def _manifest(sharded: dict[str, ShardedTensor]) -> Manifest:
    files = [FileEntry("m.t.tree.msgpack", 10, 1), FileEntry("m.t.rank0.safetensors", 200, 2)]
    return Manifest(
        schema_version=schema_for({"m": ComponentEntry("m.t.tree.msgpack", sharded=sharded)}),
        step=1,
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
        library_version="0",
        components={"m": ComponentEntry("m.t.tree.msgpack", sharded=sharded)},
        files=files,
    )


def test_schema_2_only_for_checkpoints_with_shards() -> None:
    whole = tensor(shard([0, 0], [4, 6]))
    assert _manifest({"w": whole}).schema_version == 2
    assert _manifest({}).schema_version == 1
    assert decode_manifest(encode_manifest(_manifest({"w": whole}))).components["m"].sharded


def test_a_manifest_whose_shards_overlap_or_name_unlisted_files_is_corrupt() -> None:
    overlapping = tensor(shard([0, 0], [3, 6]), shard([2, 0], [1, 6]))
    with pytest.raises(CorruptCheckpointError, match=r"overlap|elements"):
        decode_manifest(encode_manifest(_manifest({"w": overlapping})))
    elsewhere = tensor(shard([0, 0], [4, 6], file="other.safetensors"))
    with pytest.raises(CorruptCheckpointError, match="is not listed"):
        decode_manifest(encode_manifest(_manifest({"w": elsewhere})))
    negative = msgspec.structs.replace(
        tensor(shard([0, 0], [4, 6])), shards=[shard([0, 0], [4, 6])]
    )
    negative = msgspec.structs.replace(
        negative, shards=[msgspec.structs.replace(negative.shards[0], block_bytes=0)]
    )
    with pytest.raises(CorruptCheckpointError, match="block size"):
        decode_manifest(encode_manifest(_manifest({"w": negative})))


def test_intersect_boxes() -> None:
    assert intersect(((0, 0), (4, 6)), ((2, 3), (4, 4))) == ((2, 3), (2, 3))
    assert intersect(((0,), (4,)), ((4,), (2,))) is None
    assert intersect(((), ()), ((), ())) == ((), ())


def test_the_publisher_refuses_shards_from_ranks_that_disagree() -> None:
    from checkpointd.errors import RankFailedError
    from checkpointd.write.ranked_merge import Share, _merge_shards

    def share(*shards: ShardEntry, dtype: str = "float32") -> Share:
        return Share([], {}, {}, {"m": {"w": ShardedTensor(dtype, [4, 6], list(shards))}})

    entry = ComponentEntry("m.t.tree.msgpack", sharded={"w": tensor()})
    top, bottom = shard([0, 0], [2, 6]), shard([2, 0], [2, 6], file="m.t.rank1.safetensors")
    merged = _merge_shards(1, "m", entry, [share(top), share(bottom)])
    assert [s.offsets for s in merged.sharded["w"].shards] == [[0, 0], [2, 0]]
    with pytest.raises(RankFailedError, match="do not tile"):
        _merge_shards(1, "m", entry, [share(top), share(top)])
    with pytest.raises(RankFailedError, match="disagree on DTensor m/w"):
        _merge_shards(1, "m", entry, [share(top), share(bottom, dtype="bfloat16")])


def test_a_rank_posts_only_the_shards_it_wrote_and_the_publisher_merges_them() -> None:
    """A replica that writes none of a tensor's shards, or holds an empty tail chunk,
    posts nothing of it; the merge still needs every byte of the tensor."""
    from checkpointd.errors import RankFailedError
    from checkpointd.write.ranked_merge import Share, _merge_shards, written_shards

    empty = shard([4, 0], [0, 6], file="m.t.rank2.safetensors")
    components = {
        "m": ComponentEntry("m.t.tree.msgpack", sharded={"w": tensor(empty), "v": tensor()}),
        "rng-rank2": ComponentEntry("rng-rank2.t.tree.msgpack"),
    }
    assert written_shards(components, {"rng-rank2": "rng"}) == {}
    top, bottom = shard([0, 0], [2, 6]), shard([2, 0], [2, 6], file="m.t.rank1.safetensors")
    components["m"] = ComponentEntry("m.t.tree.msgpack", sharded={"w": tensor(top, empty)})
    assert written_shards(components, {}) == {"m": {"w": tensor(top)}}

    def share(*shards: ShardEntry) -> Share:
        return Share([], {}, {}, {"m": {"w": tensor(*shards)}} if shards else {})

    entry = ComponentEntry("m.t.tree.msgpack", sharded={"w": tensor()})
    merged = _merge_shards(1, "m", entry, [share(top), share(), share(bottom)])
    assert merged.sharded["w"] == tensor(top, bottom)
    with pytest.raises(RankFailedError, match="do not tile"):
        _merge_shards(1, "m", entry, [share(top), share()])
    stray = Share([], {}, {}, {"m": {"x": tensor(top)}})
    with pytest.raises(RankFailedError, match="disagree on DTensor m/x"):
        _merge_shards(1, "m", entry, [share(top), share(bottom), stray])
