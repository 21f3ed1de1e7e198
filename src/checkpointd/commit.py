"""The write path and commit protocol for one snapshot, and retention after it.

Runs on the writer's event loop; blocking storage calls go to worker threads.
Order: create the step folder; write every file concurrently (bounded), each
to a temporary name or an uncommitted upload, computing CRC32C as the bytes go
out, then commit it (fsync + rename, or complete the upload); fsync the
folder; publish the manifest exclusively. Only then is the checkpoint visible.
On any failure every file this save wrote is removed and nothing is published.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from checkpointd import __version__
from checkpointd.capture import CapturedComponent, StagingBuffer
from checkpointd.catalog import infos, step_path
from checkpointd.checksum import BytesLike, crc32c
from checkpointd.directio import DIRECT_ALIGN, DIRECT_MIN_BYTES
from checkpointd.errors import CheckpointExistsError
from checkpointd.format import (
    encode_safetensors_header,
    encode_tree,
    tensor_file_name,
    tree_file_name,
)
from checkpointd.lease import Lease, claim, release
from checkpointd.manifest import (
    MANIFEST_NAME,
    SCHEMA_VERSION,
    CheckpointInfo,
    ComponentEntry,
    FileEntry,
    Manifest,
    encode_manifest,
    step_dirname,
)
from checkpointd.retention import (
    RetentionPolicy,
    RetentionWarning,
    plan_retention,
    unranked_warning,
)
from checkpointd.storage import FileSink, Store

__all__ = ["Snapshot", "apply_retention", "write_snapshot"]

CHUNK_BYTES = 16 * 2**20
T = TypeVar("T")


@dataclass(slots=True)
class Snapshot:
    """Everything one save needs after capture; owned by the writer until it resolves."""

    step: int
    components: list[CapturedComponent]
    buffer: StagingBuffer
    created_at: datetime
    metrics: dict[str, Any]
    metadata: dict[str, Any]


async def _in_thread(limiter: anyio.CapacityLimiter, fn: Callable[..., T], *args: Any) -> T:
    return await anyio.to_thread.run_sync(functools.partial(fn, *args), limiter=limiter)


def _stream_file(store: Store, path: str, parts: Sequence[BytesLike]) -> tuple[FileSink, FileEntry]:
    """Write ``parts`` to an uncommitted ``path``, digesting as they go. Worker thread."""
    sink = store.open_file(path, size=sum(memoryview(part).nbytes for part in parts))
    try:
        digest = 0
        size = 0
        for part in parts:
            view = memoryview(part).cast("B")
            for start in range(0, len(view), CHUNK_BYTES):
                chunk = view[start : start + CHUNK_BYTES]
                digest = crc32c(chunk, digest)
                sink.write(chunk)
                size += len(chunk)
    except BaseException:
        sink.discard()
        raise
    return sink, FileEntry(path=path.rpartition("/")[2], size=size, crc32c=digest)


def _commit_file(sink: FileSink) -> None:
    """Make one streamed file durable under its final name, or discard it. Worker thread."""
    try:
        sink.commit()
    except BaseException:
        sink.discard()
        raise


async def write_snapshot(
    store: Store, snapshot: Snapshot, limiter: anyio.CapacityLimiter
) -> CheckpointInfo:
    """Write, commit and publish ``snapshot``; return its CheckpointInfo once it is durable.

    Raises CheckpointExistsError if the step is already committed (before writing
    anything) or another writer holds or wins it; StorageError on I/O failure.
    """
    folder = step_dirname(snapshot.step)
    manifest_path = f"{folder}/{MANIFEST_NAME}"
    await _in_thread(limiter, store.make_dir, folder)
    if await _in_thread(limiter, store.exists, manifest_path):
        raise CheckpointExistsError(
            f"step {snapshot.step} is already committed at {step_path(store, snapshot.step)}"
        )

    streamed: list[tuple[FileSink, FileEntry]] = []
    committed: list[FileEntry] = []
    components: dict[str, ComponentEntry] = {}
    lease: Lease | None = None

    async def stream(path: str, parts: Sequence[BytesLike]) -> None:
        streamed.append(await _in_thread(limiter, _stream_file, store, f"{folder}/{path}", parts))

    async def commit(sink: FileSink, entry: FileEntry) -> None:
        await _in_thread(limiter, _commit_file, sink)
        streamed.remove((sink, entry))
        committed.append(entry)

    try:
        async with anyio.create_task_group() as group:
            for component in snapshot.components:
                tree_name = tree_file_name(component.name)
                tensor_names: list[str] = []
                tree_parts: list[BytesLike] = [encode_tree(component.tree)]
                group.start_soon(stream, tree_name, tree_parts)
                if component.entries:
                    tensor_names.append(tensor_file_name(component.name))
                    # Large data regions start 4 KiB-aligned in the file for direct I/O.
                    align = DIRECT_ALIGN if component.nbytes >= DIRECT_MIN_BYTES else 8
                    header = encode_safetensors_header(component.entries, align=align)
                    data = snapshot.buffer.view(component.offset, component.nbytes)
                    tensor_parts: list[BytesLike] = [header, data]
                    group.start_soon(stream, tensor_names[0], tensor_parts)
                components[component.name] = ComponentEntry(
                    tree=tree_name,
                    tensors=tensor_names,
                    nbytes=component.nbytes,
                    num_tensors=len(component.entries),
                )
        lease = await _in_thread(limiter, claim, store, folder)
        # Another writer may have committed this step and released the lease since our
        # first check: committing now would overwrite its files.
        if await _in_thread(limiter, store.exists, manifest_path):
            raise CheckpointExistsError(
                f"step {snapshot.step} was committed by another writer at "
                f"{step_path(store, snapshot.step)}"
            )
        async with anyio.create_task_group() as group:
            for sink, entry in list(streamed):
                group.start_soon(commit, sink, entry)
        await _in_thread(limiter, store.sync_dir, folder)
        manifest = Manifest(
            schema_version=SCHEMA_VERSION,
            step=snapshot.step,
            created_at=snapshot.created_at,
            library_version=__version__,
            components=components,
            files=sorted(committed, key=lambda f: f.path),
            metrics=snapshot.metrics,
            metadata=snapshot.metadata,
        )
        await _in_thread(limiter, store.publish, manifest_path, encode_manifest(manifest))
    except BaseException:
        with anyio.CancelScope(shield=True):
            await _in_thread(limiter, _clean_up, store, folder, streamed, committed, lease)
        raise
    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
        await _in_thread(limiter, release, store, folder, lease)
    return CheckpointInfo.from_manifest(manifest, step_path(store, snapshot.step))


def _clean_up(
    store: Store,
    folder: str,
    streamed: list[tuple[FileSink, FileEntry]],
    committed: list[FileEntry],
    lease: Lease | None,
) -> None:
    """Undo a failed save: discard uploads, remove committed files, drop our lease.

    Files are removed only while we hold the lease: without it, files under these
    names may belong to the writer that holds it. Best effort; worker thread.
    """
    for sink, _ in streamed:
        with contextlib.suppress(Exception):
            sink.discard()
    if lease is None:
        return
    try:
        published = store.exists(f"{folder}/{MANIFEST_NAME}")
    except Exception:
        published = True  # unknown: keep the files; gc removes them if no manifest appears
    if published:
        # A publish with an unknown outcome landed: the checkpoint is complete and visible,
        # so its files must stay (removing them would tear it).
        committed = []
    for entry in committed:
        with contextlib.suppress(Exception):
            store.remove_file(f"{folder}/{entry.path}")
    with contextlib.suppress(Exception):
        release(store, folder, lease)


def _delete_checkpoint(store: Store, step: int) -> None:
    """Remove a committed checkpoint: its manifest first, so it is never seen half-deleted.

    Once the manifest is gone the folder is not a checkpoint: if removing the
    rest fails or the process dies, what is left is a leftover for GC, which no
    reader lists or loads. Worker thread (blocking).
    """
    folder = step_dirname(step)
    store.remove_file(f"{folder}/{MANIFEST_NAME}")
    store.remove_dir(folder)


async def apply_retention(
    store: Store,
    policy: RetentionPolicy,
    limiter: anyio.CapacityLimiter,
    *,
    committed_step: int | None = None,
) -> list[int]:
    """Delete the committed checkpoints ``policy`` drops; return their steps, oldest first.

    Call only after a commit, with that commit's step. Only committed checkpoints
    are considered: a save still in flight has no manifest, so it is neither
    counted nor touched, and the newest committed checkpoint (and
    ``committed_step``) is never deleted, so a durable checkpoint always remains.
    Warns (RetentionWarning) if ``committed_step`` lacks the best metric.
    """
    if not policy.deletes_anything:
        return []
    protect = () if committed_step is None else (committed_step,)
    plan = plan_retention(await _in_thread(limiter, infos, store), policy, protect=protect)
    deleted: list[int] = []
    for victim in plan.delete:
        await _in_thread(limiter, _delete_checkpoint, store, victim.step)
        deleted.append(victim.step)
    if committed_step is not None and committed_step in plan.unranked:
        # Only the new step: older unranked steps were reported when they were committed.
        warnings.warn(unranked_warning([committed_step], policy), RetentionWarning, stacklevel=2)
    return deleted
