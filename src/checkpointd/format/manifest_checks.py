"""Checks of a decoded manifest: names that stay inside the step folder, shards that
tile their tensors, blobs that are listed (docs/format.md). Pure; any thread."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from checkpointd.errors import CorruptCheckpointError
from checkpointd.format.layout import (
    MANIFEST_NAME,
    is_blob_name,
    is_component_name,
    is_safe_file_name,
)

if TYPE_CHECKING:
    from checkpointd.format.manifest import Manifest, ShardedTensor, ShardEntry

__all__ = ["check_consistency", "shard_problem"]


def check_consistency(manifest: Manifest, where: str) -> None:
    """Refuse a manifest whose names could escape the step folder or that contradicts itself."""
    if manifest.step < 0:
        raise CorruptCheckpointError(f"{where}: negative step {manifest.step}")
    listed: set[str] = set()
    for entry in manifest.files:
        if not is_safe_file_name(entry.path) or entry.path == MANIFEST_NAME:
            raise CorruptCheckpointError(f"{where}: unsafe file name {entry.path!r}")
        if entry.size < 0 or not 0 <= entry.crc32c < 2**32:
            raise CorruptCheckpointError(f"{where}: invalid size or digest for {entry.path!r}")
        if entry.path in listed:
            raise CorruptCheckpointError(f"{where}: file {entry.path!r} listed twice")
        listed.add(entry.path)
    for name, component in manifest.components.items():
        if not is_component_name(name):
            raise CorruptCheckpointError(f"{where}: unsafe component name {name!r}")
        for path in (component.tree, *component.tensors):
            if path not in listed:
                raise CorruptCheckpointError(
                    f"{where}: component {name!r} refers to unlisted file {path!r}"
                )
    blobs = _check_blobs(manifest, where)
    _check_indexes(manifest, listed, where)
    whole = not manifest.shard_indexes  # else the indexes hold shards too: checked on reading
    for name, component in manifest.components.items():
        for tensor, sharded in component.sharded.items():
            if problem := shard_problem(sharded, listed, blobs, whole=whole):
                raise CorruptCheckpointError(f"{where}: sharded tensor {name}/{tensor}: {problem}")
            if manifest.schema_version < 3 and any(s.blob for s in sharded.shards):
                raise CorruptCheckpointError(
                    f"{where}: sharded tensor {name}/{tensor} has shards in blobs in a "
                    f"schema_version {manifest.schema_version} manifest"
                )
    for name, keys in manifest.per_rank.items():
        if len(keys) != manifest.world_size or not set(keys) <= set(manifest.components):
            raise CorruptCheckpointError(f"{where}: per-rank component {name!r} is incomplete")


def shard_problem(
    sharded: ShardedTensor,
    files: set[str] | None = None,
    blobs: set[str] | None = None,
    *,
    whole: bool = True,
) -> str | None:
    """What is wrong with a sharded tensor's entry, or None: each shard must lie inside the
    global shape, list a file from ``files`` or a blob from ``blobs`` (when given; a blob
    shard begins at 0) and a CRC32C per block, and (``whole``: these are all its shards)
    the shards must tile the tensor exactly (their volumes add up to it and no two
    overlap)."""
    shape = sharded.shape
    if any(d < 0 for d in shape):
        return f"negative dimension in shape {shape}"
    total = 0
    for shard in sharded.shards:
        box = list(zip(shard.offsets, shard.shape, strict=False))
        if len(box) != len(shape) or len(shard.shape) != len(shape):
            return f"shard at {shard.offsets} has another rank than shape {shape}"
        if any(o < 0 or n < 0 or o + n > d for (o, n), d in zip(box, shape, strict=True)):
            return f"shard at {shard.offsets} of shape {shard.shape} lies outside {shape}"
        if shard.blob:
            if (blobs is not None and shard.blob not in blobs) or shard.file or shard.begin:
                return f"shard at {shard.offsets}: blob {shard.blob!r} is not listed alone"
        elif files is not None and shard.file not in files:
            return f"shard file {shard.file!r} is not listed"
        if shard.block_bytes <= 0 or shard.begin < 0:
            return f"shard at {shard.offsets}: invalid begin or block size"
        total += math.prod(shard.shape)
    if not whole:
        return None
    if total != math.prod(shape):
        return f"shards hold {total} elements, the tensor {math.prod(shape)}"
    shards = sorted((s for s in sharded.shards if math.prod(s.shape)), key=lambda s: s.offsets)
    for i, a in enumerate(shards):
        for b in shards[i + 1 :]:
            if shape and b.offsets[0] >= a.offsets[0] + a.shape[0]:
                break  # sorted by the first offset: no later shard reaches back into a
            if _overlap(a, b):
                return f"shards at {a.offsets} and {b.offsets} overlap"
    return None


def _overlap(a: ShardEntry, b: ShardEntry) -> bool:
    return all(
        ao < bo + bn and bo < ao + an
        for ao, an, bo, bn in zip(a.offsets, a.shape, b.offsets, b.shape, strict=True)
    )


def _check_indexes(manifest: Manifest, listed: set[str], where: str) -> None:
    """Refuse shard indexes that are not listed files, listed twice, or in a manifest of
    a schema before 4."""
    if manifest.shard_indexes and manifest.schema_version < 4:
        raise CorruptCheckpointError(
            f"{where}: shard indexes in a schema_version {manifest.schema_version} manifest"
        )
    if len(set(manifest.shard_indexes)) != len(manifest.shard_indexes):
        raise CorruptCheckpointError(f"{where}: a shard index is listed twice")
    for path in manifest.shard_indexes:
        if path not in listed:
            raise CorruptCheckpointError(f"{where}: shard index {path!r} is not a listed file")


def _check_blobs(manifest: Manifest, where: str) -> set[str]:
    """Refuse blob names that could escape ``blobs/``, duplicates, and refs to unlisted
    blobs; return the names listed."""
    blobs: set[str] = set()
    for blob in manifest.blobs:
        if not is_blob_name(blob.name) or blob.size < 0:
            raise CorruptCheckpointError(f"{where}: invalid blob entry {blob.name!r}")
        if blob.name in blobs:
            raise CorruptCheckpointError(f"{where}: blob {blob.name!r} listed twice")
        blobs.add(blob.name)
    if blobs and manifest.schema_version < 2:
        raise CorruptCheckpointError(f"{where}: blobs in a schema_version 1 manifest")
    for name, component in manifest.components.items():
        for tensor, ref in component.refs.items():
            if ref.blob not in blobs:
                raise CorruptCheckpointError(
                    f"{where}: component {name!r} tensor {tensor!r} refers to unlisted blob "
                    f"{ref.blob!r}"
                )
    return blobs
