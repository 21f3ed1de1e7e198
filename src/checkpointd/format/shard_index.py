"""Shard index files (schema 4): one rank's shard entries, stored next to its data.

A many-rank save of many shards would list ranks x sharded tensors shard entries
(each with a CRC32C per block) in the manifest, which outgrows
``tunables.MAX_MANIFEST_BYTES`` at a few hundred ranks. Above
``tunables.SHARD_INDEX_MIN_ENTRIES`` each rank writes the entries of the shards it
stored to ``shards.T.rankR.json`` instead; the manifest lists that file like any
other (``files``: size, CRC32C, rank) and names it in ``shard_indexes``, and a
reader loads the indexes it needs. docs/format.md is the spec. Pure; any thread.
"""

from __future__ import annotations

import msgspec

from checkpointd import tunables
from checkpointd.errors import CorruptCheckpointError, UnsupportedValueError
from checkpointd.format.manifest import ShardEntry

__all__ = ["ShardIndex", "decode_index", "encode_index", "uses_indexes"]


class ShardIndex(msgspec.Struct, frozen=True):
    """What one rank's index file holds: the step and the rank that wrote it, and per
    component, per sharded tensor, the shards it stored (the entries the manifest would
    otherwise list in ``components[C].sharded[name].shards``)."""

    step: int
    rank: int
    components: dict[str, dict[str, list[ShardEntry]]]


def uses_indexes(world_size: int, sharded_tensors: int, min_entries: int) -> bool:
    """Whether a save of ``world_size`` ranks holding ``sharded_tensors`` sharded tensors
    (the same count on every rank) stores its shard entries in index files: when the
    manifest would list at least ``min_entries`` of them (the saving trainer's
    ``tunables.SHARD_INDEX_MIN_ENTRIES``). Every rank decides the same from the same
    numbers; a process saving alone never does."""
    return world_size > 1 and world_size * sharded_tensors >= min_entries


def encode_index(index: ShardIndex) -> bytes:
    """``index`` as JSON (its digest is the manifest's ``files`` entry). Raises
    UnsupportedValueError over tunables.MAX_MANIFEST_BYTES, which no reader accepts."""
    data = msgspec.json.encode(index)
    if len(data) > tunables.MAX_MANIFEST_BYTES:
        raise UnsupportedValueError(
            f"rank {index.rank}'s shard index of step {index.step} would be {len(data):,} "
            f"bytes, over the {tunables.MAX_MANIFEST_BYTES:,} any reader accepts; save "
            "fewer tensors per rank"
        )
    return data


def decode_index(data: bytes, *, step: int, rank: int, where: str) -> ShardIndex:
    """Decode an index file already checked against its manifest entry (size, CRC32C):
    CorruptCheckpointError unless it parses and names ``step`` and ``rank``. The shards'
    own checks (inside their tensor, files listed) are the reader's, against the manifest."""
    if len(data) > tunables.MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{where}: {len(data)} bytes is too large for a shard index")
    try:
        index = msgspec.json.decode(data, type=ShardIndex)
    except RecursionError:
        raise CorruptCheckpointError(f"{where}: JSON nested too deep to decode") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptCheckpointError(f"{where}: not a shard index ({exc})") from exc
    if (index.step, index.rank) != (step, rank):
        raise CorruptCheckpointError(
            f"{where}: the index of step {index.step} rank {index.rank}, not of step {step} "
            f"rank {rank}"
        )
    return index
