"""What the memory tier keeps of a committed save: its files as a head (small bytes)
and a range of the segment the trainer captured into (no copy). Service side, worker
thread, after the save committed and before its client hears so. Imports torch (plan).

One way for every save, alone or one rank of many: the files of the plan it
committed whose bytes this process's segment has (alone: every file; a rank: the
files of replicated components, which every rank holds alike whichever rank wrote
them, its own shard and per-rank files, its shard index file), each vouched for by
its CRC32C. For a file this process's commit wrote, that is the entry it committed
(computed over these very bytes as they streamed); for a replicated file another
rank wrote, it is computed here over this rank's bytes (for FSDP2/TP the trees and
the small unsharded tensors; for DDP about (W-1)/W of the state: one CRC32C pass).
Nothing is read back from storage. A client serves a file only if storage's
manifest lists that path, size and CRC32C (client/recall.py), so a step replaced or
re-committed since is served from memory only where its bytes are these.
Incremental saves (blobs, refs) are not held.
"""

from __future__ import annotations

from dataclasses import dataclass

from checkpointd.daemon.server.memtier import HeldCheckpoint
from checkpointd.daemon.wire import protocol as p
from checkpointd.daemon.wire.shm import MappedSegment
from checkpointd.format.layout import shard_file_name
from checkpointd.format.manifest import FileEntry
from checkpointd.write.capture import CapturedComponent
from checkpointd.write.items import RankFile, WriteFile, file_crc32c
from checkpointd.write.loop import InProcessBackend
from checkpointd.write.plan import SavePlan, Snapshot
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
    if committed is None or service.incremental is not None:
        return None
    group = service.group
    rank = 0 if group is None else group.rank
    plan = committed.plan
    written = {f.path: f for f in committed.written}
    items = [f for f in plan.files if isinstance(f, WriteFile | RankFile)]  # not blobs
    token = None  # alone: no shard files
    if group is not None:
        token = f"{group.token}{snapshot.attempt}"  # as the write service named the files
        index = shard_index(
            plan, group, snapshot.attempt, written_shards(plan.components, plan.per_rank)
        )
        if index is not None:
            items.append(index)
    components = {c.name: c for c in snapshot.components}
    files: list[p.HeldFile] = []
    for item in items:
        placed = _placed(item, components.get(item.component), token)
        if placed is None:
            continue
        head, offset, length = placed
        if item.rank == rank:  # this process's commit wrote it from these bytes
            entry = written.get(item.name)
            if entry is None or entry.size != len(head) + length:
                continue
            digest = entry.crc32c
        else:  # another rank wrote it: its CRC32C from these bytes (or capture's)
            digest = file_crc32c(item)
        files.append(p.HeldFile(item.name, head, offset, length, digest))
    if not files:
        return None
    return HeldCheckpoint(snapshot.step, segment, files, rank=None if group is None else rank)


def _placed(
    item: WriteFile | RankFile, component: CapturedComponent | None, token: str | None
) -> tuple[bytes, int, int] | None:
    """Where ``item``'s bytes lie: its head, then (offset, length) of the segment; None
    for a file made otherwise (a tensor file leaving out tensors stored as blobs).
    ``token``: the group's file token, None alone (no shard files)."""
    if len(item.parts) == 1:
        return bytes(item.parts[0]), 0, 0  # a tree or a shard index: head only
    if len(item.parts) != 2 or component is None:
        return None
    head, length = bytes(item.parts[0]), memoryview(item.parts[1]).nbytes
    if token is not None and item.name == shard_file_name(component.name, token, item.rank):
        offset, nbytes = component.shard_offset, component.shard_nbytes
    else:
        offset, nbytes = component.offset, component.nbytes
    return (head, offset, length) if length == nbytes else None
