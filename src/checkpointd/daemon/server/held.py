"""What the memory tier keeps of a committed save: its files as a head (small bytes)
and a range of the segment the trainer captured into (no copy). Service side, worker
thread, after the save committed and before its client hears so. Imports torch (plan).

- Alone: the manifest the service published (read back) and every file it lists; a
  client serves the copy only if storage's manifest is byte for byte that one.
- One rank of a many-rank save: the job's publisher wrote the manifest, so the copy
  vouches for each file instead: the files whose bytes this rank's segment has (those
  of replicated components, which every rank holds alike whichever rank wrote them;
  this rank's shard and per-rank files; its shard index file), each with its CRC32C.
  For a file this rank's commit wrote, that is the entry it committed (computed over
  these very bytes as they streamed); for a replicated file another rank wrote, it
  is computed here over this rank's bytes (for FSDP2/TP the trees and the small
  unsharded tensors; for DDP about (W-1)/W of the state: one CRC32C pass). Nothing
  is read back from storage (the manifest grows with the job). A client serves a
  file only if storage's manifest lists that path, size and CRC32C (recall.py).
  Incremental saves (blobs, refs) are not held either way.
"""

from __future__ import annotations

from dataclasses import dataclass

from checkpointd.daemon.server.memtier import HeldCheckpoint
from checkpointd.daemon.wire import protocol as p
from checkpointd.daemon.wire.shm import MappedSegment
from checkpointd.format.checksum import crc32c
from checkpointd.format.layout import (
    MANIFEST_NAME,
    shard_file_name,
    step_dirname,
    tensor_file_name,
    tree_file_name,
)
from checkpointd.format.manifest import FileEntry, decode_manifest
from checkpointd.write.capture import CapturedComponent
from checkpointd.write.items import RankFile, WriteFile
from checkpointd.write.loop import InProcessBackend
from checkpointd.write.plan import SavePlan, Snapshot, plan_snapshot
from checkpointd.write.ranked_merge import shard_index, written_shards

__all__ = ["Committed", "held_checkpoint"]


@dataclass(frozen=True)
class Committed:
    """What a save committed: its plan, and the entries (size, CRC32C) of the files this
    process wrote of it (``InProcessBackend.committed_plan``)."""

    plan: SavePlan
    written: list[FileEntry]


def held_checkpoint(
    service: InProcessBackend,
    snapshot: Snapshot,
    committed: Committed | None,
    segment: MappedSegment,
) -> HeldCheckpoint | None:
    """What the memory tier keeps of ``snapshot``, just committed by ``service``
    (``committed``: what it committed, None if unknown), or None: nothing to hold."""
    if service.group is None:
        return _held_alone(service, snapshot, segment)
    if committed is None or service.incremental is not None:
        return None
    return _held_share(service, snapshot, committed, segment)


def _held_alone(
    service: InProcessBackend, snapshot: Snapshot, segment: MappedSegment
) -> HeldCheckpoint | None:
    """A single-process save: the manifest it published (read back) and, per listed
    file, its head and its range of the segment; None if the manifest lists anything
    this snapshot does not hold."""
    store, step = service.store, snapshot.step
    path = f"{step_dirname(step)}/{MANIFEST_NAME}"
    manifest_bytes = store.read_bytes(path)  # read once: kept as is, and decoded
    manifest = decode_manifest(manifest_bytes, where=f"{store.url}/{path}")
    if manifest.step != step:  # (read_manifest's check: not what this save published)
        return None
    token = "m"
    planned = {f.name: f for f in plan_snapshot(snapshot, token).files if isinstance(f, WriteFile)}
    offsets = {c.name: c.offset for c in snapshot.components}
    files: list[p.HeldFile] = []
    for name, entry in manifest.components.items():
        tree = planned.get(tree_file_name(name, token))
        if tree is None or entry.sharded or entry.refs:
            return None
        files.append(p.HeldFile(entry.tree, bytes(tree.parts[0])))
        if entry.tensors:
            tensors = planned.get(tensor_file_name(name, token))
            if tensors is None or len(entry.tensors) != 1:
                return None
            head = bytes(tensors.parts[0])
            length = memoryview(tensors.parts[1]).nbytes
            files.append(p.HeldFile(entry.tensors[0], head, offsets[name], length))
    sizes = {f.path: f.size for f in manifest.files}
    held = {f.path: len(f.head) + f.length for f in files}
    if sizes != held or manifest.blobs:
        return None
    return HeldCheckpoint(step, segment, manifest_bytes, files)


def _held_share(
    service: InProcessBackend, snapshot: Snapshot, committed: Committed, segment: MappedSegment
) -> HeldCheckpoint | None:
    """One rank's share of a many-rank save (see the module docstring); None if it
    holds no file."""
    group = service.group
    assert group is not None
    plan = committed.plan
    written = {f.path: f for f in committed.written}
    token = f"{group.token}{snapshot.attempt}"  # as the write service named the files
    components = {c.name: c for c in snapshot.components}
    items = [f for f in plan.files if isinstance(f, WriteFile | RankFile)]  # not blobs
    index = shard_index(
        plan, group, snapshot.attempt, written_shards(plan.components, plan.per_rank)
    )
    if index is not None:
        items.append(index)
    files: list[p.HeldFile] = []
    for item in items:
        placed = _placed(item, components.get(item.component), token)
        if placed is None:
            continue
        head, offset, length = placed
        if item.rank == group.rank:  # this rank's commit wrote it from these bytes
            entry = written.get(item.name)
            if entry is None or entry.size != len(head) + length:
                continue
            digest = entry.crc32c
        else:
            digest = crc32c(head)
            for part in item.parts[1:]:
                digest = crc32c(memoryview(part).cast("B"), digest)
        files.append(p.HeldFile(item.name, head, offset, length, digest))
    if not files:
        return None
    return HeldCheckpoint(snapshot.step, segment, b"", files, rank=group.rank)


def _placed(
    item: WriteFile | RankFile, component: CapturedComponent | None, token: str
) -> tuple[bytes, int, int] | None:
    """Where ``item``'s bytes lie: its head, then (offset, length) of the segment; None
    for a file made otherwise (a tensor file leaving out tensors stored as blobs)."""
    if len(item.parts) == 1:
        return bytes(item.parts[0]), 0, 0  # a tree or a shard index: head only
    if len(item.parts) != 2 or component is None:
        return None
    head, length = bytes(item.parts[0]), memoryview(item.parts[1]).nbytes
    if item.name == shard_file_name(component.name, token, item.rank):
        offset, nbytes = component.shard_offset, component.shard_nbytes
    else:
        offset, nbytes = component.offset, component.nbytes
    return (head, offset, length) if length == nbytes else None
