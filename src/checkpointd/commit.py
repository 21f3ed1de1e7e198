"""The write path and commit protocol for one snapshot, and retention after it.

Runs on the writer's event loop; blocking storage calls go to worker threads.
Order: create the step folder; write every file concurrently (bounded), each
under a name unique to this attempt (``{component}.{token}.safetensors``), to
a temporary name or an uncommitted upload, computing CRC32C as the bytes go
out, then commit it (fsync + rename, or complete the upload); fsync the
folder; publish the manifest exclusively. Only then is the checkpoint visible.
The exclusive publish alone decides between attempts at the same step: no
lock, so nothing a dead writer left can block a live one. On any failure
(losing the publish included) every file this attempt wrote is removed and
nothing is published; the winner removes old leftovers of earlier attempts.
"""

from __future__ import annotations

import contextlib
import functools
import secrets
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from checkpointd import __version__
from checkpointd.capture import CapturedComponent, StagingBuffer
from checkpointd.catalog import committed as committed_manifests
from checkpointd.catalog import read_manifest, step_path
from checkpointd.checksum import BytesLike, crc32c
from checkpointd.cleanup import DEFAULT_OLDER_THAN, remove_leftovers, unreferenced_files
from checkpointd.errors import CheckpointExistsError, CheckpointNotFoundError, StorageError
from checkpointd.format import encode_safetensors_header, encode_tree
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
    WriterIdentity,
    plan_retention,
    unranked_warning,
)
from checkpointd.storage import FileSink, Store
from checkpointd.storage.directio import DIRECT_ALIGN, DIRECT_MIN_BYTES

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


def _file_names(component: str, token: str) -> tuple[str, str]:
    """(tree file, tensor file) of ``component`` for the save attempt ``token``."""
    return f"{component}.{token}.tree.msgpack", f"{component}.{token}.safetensors"


async def write_snapshot(
    store: Store,
    snapshot: Snapshot,
    limiter: anyio.CapacityLimiter,
    *,
    identity: WriterIdentity | None = None,
) -> CheckpointInfo:
    """Write, commit and publish ``snapshot``; return its CheckpointInfo once it is durable.

    Every file gets a name unique to this attempt, so concurrent or dead attempts
    at the same step never touch each other's files; the exclusive publish of the
    manifest alone decides which attempt is the checkpoint. Raises
    CheckpointExistsError if the step is already committed (before writing
    anything) or another writer publishes it first (after removing this attempt's
    files); StorageError on I/O failure. ``identity`` (the writer's) is recorded in
    the manifest and told of the commit.
    """
    folder = step_dirname(snapshot.step)
    manifest_path = f"{folder}/{MANIFEST_NAME}"
    await _in_thread(limiter, store.make_dir, folder)
    if await _in_thread(limiter, store.exists, manifest_path):
        raise CheckpointExistsError(
            f"step {snapshot.step} is already committed at {step_path(store, snapshot.step)}"
        )

    token = secrets.token_hex(4)
    streamed: list[tuple[FileSink, FileEntry]] = []
    committed: list[FileEntry] = []
    components: dict[str, ComponentEntry] = {}

    async def stream(path: str, parts: Sequence[BytesLike]) -> None:
        streamed.append(await _in_thread(limiter, _stream_file, store, f"{folder}/{path}", parts))

    async def commit(sink: FileSink, entry: FileEntry) -> None:
        await _in_thread(limiter, _commit_file, sink)
        streamed.remove((sink, entry))
        committed.append(entry)

    try:
        async with anyio.create_task_group() as group:
            for component in snapshot.components:
                tree_name, tensor_name = _file_names(component.name, token)
                tensor_names: list[str] = []
                tree_parts: list[BytesLike] = [encode_tree(component.tree)]
                group.start_soon(stream, tree_name, tree_parts)
                if component.entries:
                    tensor_names.append(tensor_name)
                    # Large data regions start 4 KiB-aligned in the file for direct I/O.
                    align = DIRECT_ALIGN if component.nbytes >= DIRECT_MIN_BYTES else 8
                    header = encode_safetensors_header(component.entries, align=align)
                    data = snapshot.buffer.view(component.offset, component.nbytes)
                    tensor_parts: list[BytesLike] = [header, data]
                    group.start_soon(stream, tensor_name, tensor_parts)
                components[component.name] = ComponentEntry(
                    tree=tree_name,
                    tensors=tensor_names,
                    nbytes=component.nbytes,
                    num_tensors=len(component.entries),
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
            writer="" if identity is None else identity.id,
        )
        try:
            await _in_thread(limiter, store.publish, manifest_path, encode_manifest(manifest))
        except CheckpointExistsError:
            raise CheckpointExistsError(
                f"step {snapshot.step} was committed by another writer at "
                f"{step_path(store, snapshot.step)}"
            ) from None
    except BaseException:
        with anyio.CancelScope(shield=True):
            await _in_thread(limiter, _clean_up, store, snapshot.step, streamed, committed)
        raise
    if identity is not None:
        identity.note_commit(time.monotonic())
    listed = [f.path for f in manifest.files]
    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
        await _in_thread(limiter, _sweep, store, folder, listed)
    return CheckpointInfo.from_manifest(manifest, step_path(store, snapshot.step))


def _sweep(store: Store, folder: str, listed: list[str]) -> None:
    """Remove what earlier (dead) attempts left in our just-committed ``folder``.

    Only files older than DEFAULT_OLDER_THAN go: a younger one may belong to a
    live attempt that lost and is removing its own files. Worker thread.
    """
    names = store.list_dir(folder)
    if set(names) <= {MANIFEST_NAME, *listed}:
        return
    old = unreferenced_files(store, folder, listed, names, older_than=DEFAULT_OLDER_THAN)
    remove_leftovers(store, old)


def _clean_up(
    store: Store,
    step: int,
    streamed: list[tuple[FileSink, FileEntry]],
    committed: list[FileEntry],
) -> None:
    """Undo a failed or losing save: discard its uploads and remove the files it committed.

    Only this attempt's own files (their names are unique to it) are touched,
    unless a manifest that lists them was published after all (a publish with an
    unknown outcome that landed): then the checkpoint is complete and visible and
    its files must stay. Best effort; worker thread.
    """
    for sink, _ in streamed:
        with contextlib.suppress(Exception):
            sink.discard()
    if not committed:
        return
    ours = {entry.path for entry in committed}
    try:
        published = read_manifest(store, step)
    except CheckpointNotFoundError:
        pass
    except Exception:
        return  # unknown: keep the files; gc removes them if no manifest lists them
    else:
        if ours & {f.path for f in published.files}:
            return
    folder = step_dirname(step)
    for path in ours:
        with contextlib.suppress(Exception):
            store.remove_file(f"{folder}/{path}")


def _delete_checkpoint(store: Store, step: int) -> None:
    """Remove a committed checkpoint: its manifest first, so it is never seen half-deleted.

    Once the manifest is gone the folder is not a checkpoint: if removing the
    rest fails or the process dies, what is left is a leftover for GC, which no
    reader lists or loads. Worker thread (blocking).
    """
    folder = step_dirname(step)
    store.remove_file(f"{folder}/{MANIFEST_NAME}")
    store.remove_dir(folder)


def _committed_at(store: Store, step: int, manifest: Manifest) -> float:
    """When ``step`` was committed (Unix seconds): its manifest's time where the store
    keeps one, and never earlier than its save was called. Worker thread."""
    created = manifest.created_at.timestamp()
    try:
        modified = store.modified(f"{step_dirname(step)}/{MANIFEST_NAME}")
    except StorageError:
        modified = None
    return created if modified is None else max(created, modified)


def _plan(
    store: Store, policy: RetentionPolicy, protect: tuple[int, ...], identity: WriterIdentity | None
) -> tuple[list[int], tuple[int, ...]]:
    """(steps to delete, unranked steps) for ``policy``, sparing another writer's fresh
    checkpoints when ``identity`` is given. Worker thread."""
    found = committed_manifests(store)
    checkpoints = [CheckpointInfo.from_manifest(m, step_path(store, s)) for s, m in found]
    plan = plan_retention(checkpoints, policy, protect=protect)
    if identity is not None and plan.delete:
        manifests = dict(found)
        foreign = {
            v.step: _committed_at(store, v.step, manifests[v.step])
            for v in plan.delete
            if manifests[v.step].writer != identity.id
        }
        if foreign:
            plan = plan_retention(
                checkpoints,
                policy,
                protect=protect,
                foreign=foreign,
                now=time.time(),
                grace=identity.grace(),
            )
    return [v.step for v in plan.delete], plan.unranked


async def apply_retention(
    store: Store,
    policy: RetentionPolicy,
    limiter: anyio.CapacityLimiter,
    *,
    committed_step: int | None = None,
    identity: WriterIdentity | None = None,
) -> list[int]:
    """Delete the committed checkpoints ``policy`` drops; return their steps, oldest first.

    Call only after a commit, with that commit's step. Only committed checkpoints
    are considered: a save still in flight has no manifest, so it is neither
    counted nor touched, and the newest committed checkpoint (and
    ``committed_step``) is never deleted, so a durable checkpoint always remains.
    With ``identity`` (the writer's), checkpoints another writer committed within
    ``identity.grace()`` seconds are kept too (see retention's module docstring).
    Warns (RetentionWarning) if ``committed_step`` lacks the best metric.
    """
    if not policy.deletes_anything:
        return []
    protect = () if committed_step is None else (committed_step,)
    victims, unranked = await _in_thread(limiter, _plan, store, policy, protect, identity)
    deleted: list[int] = []
    for step in victims:
        await _in_thread(limiter, _delete_checkpoint, store, step)
        deleted.append(step)
    if committed_step is not None and committed_step in unranked:
        # Only the new step: older unranked steps were reported when they were committed.
        warnings.warn(unranked_warning([committed_step], policy), RetentionWarning, stacklevel=2)
    return deleted
