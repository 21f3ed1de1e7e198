"""How a planned save becomes durable: the commit protocol.

Runs on the writer's event loop; blocking storage calls go to worker threads.
It knows files and blobs, not components: the plan (plan.py) says what to write,
and this is the one way any save's items become durable (write/ranked_commit.py runs
the same steps on each rank for its share). Order: create the step folder;
write every planned file concurrently (bounded), each under a name unique to
this attempt, to a temporary name or an uncommitted upload, computing CRC32C as
the bytes go out, and every new shared blob (incremental saves: temporary
name, fsync, rename); check every blob the manifest will list is still stored
(writing back one a deletion raced, from the snapshot); fsync the blob folder;
commit each file (fsync + rename, or complete the upload); fsync the folder;
publish the manifest exclusively. Only then is the checkpoint visible. The exclusive
publish alone decides between attempts at the same step: no lock, so nothing
a dead writer left can block a live one. On any failure (losing the publish
included) every file this attempt wrote is removed and nothing is published;
the winner removes old leftovers of earlier attempts. Retention runs after
(retention.apply_retention), not here.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from checkpointd import tunables
from checkpointd._version import __version__
from checkpointd.errors import CheckpointError, CheckpointExistsError, CheckpointNotFoundError
from checkpointd.format.checksum import crc32c, crc32c_combine
from checkpointd.format.layout import BLOBS_DIR, MANIFEST_NAME, step_dirname
from checkpointd.format.manifest import (
    BlobEntry,
    CheckpointInfo,
    ComponentEntry,
    FileEntry,
    Manifest,
    encode_manifest,
    schema_for,
)
from checkpointd.maintain.blobs import blob_stored, write_blob
from checkpointd.maintain.cleanup import remove_leftovers, unreferenced_files
from checkpointd.maintain.retention import WriterIdentity
from checkpointd.read.catalog import read_manifest, step_path
from checkpointd.storage import FileSink, Store
from checkpointd.storage.base import shown
from checkpointd.write.items import KeepBlob, PlannedFile, RankFile, WriteBlob, WriteFile
from checkpointd.write.plan import SavePlan

__all__ = [
    "clean_up",
    "finish_commit",
    "in_thread",
    "info_of",
    "manifest_of",
    "open_step",
    "publish_manifest",
    "publish_plan",
    "write_files",
]

_log = logging.getLogger(__name__)

T = TypeVar("T")
StepFile = WriteFile | RankFile


async def in_thread(limiter: anyio.CapacityLimiter, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread under the save's ``limiter``; from the event loop."""
    return await anyio.to_thread.run_sync(functools.partial(fn, *args), limiter=limiter)


def _stream_file(
    store: Store, folder: str, file: StepFile, chunk_bytes: int
) -> tuple[FileSink, FileEntry]:
    """Write ``file``'s parts to an uncommitted file in ``folder``, digesting as they go
    (a part whose CRC32C capture took is not read again: its digest is combined),
    ``chunk_bytes`` per write. Worker thread."""
    sink = store.open_file(f"{folder}/{file.name}", size=file.size)
    try:
        digest = 0
        size = 0
        known = file.crcs or [None] * len(file.parts)
        for part, crc in zip(file.parts, known, strict=True):
            view = memoryview(part).cast("B")
            for start in range(0, len(view), chunk_bytes):
                chunk = view[start : start + chunk_bytes]
                if crc is None:
                    digest = crc32c(chunk, digest)
                sink.write(chunk)
                size += len(chunk)
            if crc is not None:
                digest = crc32c_combine(digest, crc, len(view))
    except BaseException:
        sink.discard()
        raise
    return sink, FileEntry(path=file.name, size=size, crc32c=digest, rank=file.rank)


def _commit_file(sink: FileSink) -> None:
    """Make one streamed file durable under its final name, or discard it. Worker thread."""
    try:
        sink.commit()
    except BaseException:
        sink.discard()
        raise


def _write_blob(store: Store, blob: WriteBlob | KeepBlob, chunk_bytes: int) -> BlobEntry:
    """Write ``blob``'s bytes to ``blobs/NAME`` durably. Worker thread."""
    assert blob.parts is not None
    parts = [memoryview(part).cast("B") for part in blob.parts]
    data = parts[0] if len(parts) == 1 else memoryview(b"".join(parts))
    return write_blob(store, blob.name, data, chunk_bytes)


def _check_blob(
    store: Store, blob: WriteBlob | KeepBlob, entry: BlobEntry, chunk_bytes: int
) -> BlobEntry:
    """``entry`` if blob ``blob`` is stored with its size; else write it again from the
    snapshot's copy (same bytes, same name; a deletion in another process raced this
    save), or raise CheckpointError if the snapshot holds none. Worker thread."""
    if blob_stored(store, entry):
        return entry
    if blob.parts is None:  # only referenced by tensors capture did not copy
        raise CheckpointError(
            f"blob {entry.name} vanished before the publish and this save holds no "
            "copy of its bytes; nothing was published, the next save writes it"
        )
    return _write_blob(store, blob, chunk_bytes)


async def open_step(store: Store, step: int, limiter: anyio.CapacityLimiter) -> None:
    """Create the step folder; CheckpointExistsError if the step is already committed.

    First of a save's steps, before anything is written. Event loop."""
    folder = step_dirname(step)
    await in_thread(limiter, store.make_dir, folder)
    if await in_thread(limiter, store.exists, f"{folder}/{MANIFEST_NAME}"):
        raise CheckpointExistsError(f"step {step} is already committed at {step_path(store, step)}")


async def write_files(
    store: Store,
    step: int,
    files: Sequence[PlannedFile],
    limiter: anyio.CapacityLimiter,
    *,
    streamed: list[tuple[FileSink, FileEntry]],
    committed: list[FileEntry],
    chunk_bytes: int,
    blobs: dict[str, BlobEntry] | None = None,
) -> None:
    """Make ``files`` durable (one rank's share of a plan), bounded by ``limiter``: stream
    every step file and write every new blob; check that every blob listed (written or
    kept) is stored, writing back one that vanished; sync the blob folder; then commit
    each step file and sync the step folder.

    ``streamed`` and ``committed`` collect the step files written, so the caller can
    clean up if this raises (blobs stay: gc removes those no manifest lists); ``blobs``
    collects the entries of the blobs, for the manifest. Nothing of the step folder is
    committed until every file has streamed and every blob is stored. Event loop."""
    folder = step_dirname(step)
    blobs = {} if blobs is None else blobs
    steps = [f for f in files if isinstance(f, WriteFile | RankFile)]
    shared = [f for f in files if isinstance(f, WriteBlob | KeepBlob)]
    if shared:
        await in_thread(limiter, store.make_dir, BLOBS_DIR)

    async def stream(file: StepFile) -> None:
        streamed.append(await in_thread(limiter, _stream_file, store, folder, file, chunk_bytes))

    async def write(blob: WriteBlob) -> None:
        blobs[blob.name] = await in_thread(limiter, _write_blob, store, blob, chunk_bytes)
        _log.debug("step %d: blob %s durable (%d bytes)", step, blob.name, blobs[blob.name].size)

    async def check(blob: WriteBlob | KeepBlob) -> None:
        entry = blobs.get(blob.name, blob.entry if isinstance(blob, KeepBlob) else None)
        assert entry is not None
        blobs[blob.name] = await in_thread(limiter, _check_blob, store, blob, entry, chunk_bytes)

    async def commit(sink: FileSink, entry: FileEntry) -> None:
        await in_thread(limiter, _commit_file, sink)
        streamed.remove((sink, entry))
        committed.append(entry)
        _log.debug("step %d: %s durable (%d bytes)", step, entry.path, entry.size)

    unique = list({blob.name: blob for blob in shared}.values())
    async with anyio.create_task_group() as group:
        for file in steps:
            group.start_soon(stream, file)
        for blob in unique:
            if isinstance(blob, WriteBlob):
                group.start_soon(write, blob)
    if unique:
        async with anyio.create_task_group() as group:
            for blob in unique:
                group.start_soon(check, blob)
        await in_thread(limiter, store.sync_dir, BLOBS_DIR)
    async with anyio.create_task_group() as group:
        for sink, entry in list(streamed):
            group.start_soon(commit, sink, entry)
    await in_thread(limiter, store.sync_dir, folder)


async def publish_manifest(
    store: Store, manifest: Manifest, limiter: anyio.CapacityLimiter
) -> None:
    """Publish ``manifest`` exclusively: the commit. CheckpointExistsError if another
    writer's manifest is there first. Call only once every listed file is durable."""
    step = manifest.step
    path = f"{step_dirname(step)}/{MANIFEST_NAME}"
    try:
        await in_thread(limiter, store.publish, path, encode_manifest(manifest))
    except CheckpointExistsError:
        raise CheckpointExistsError(
            f"step {step} was committed by another writer at {step_path(store, step)}"
        ) from None
    _log.debug("step %d: manifest published at %s", step, shown(step_path(store, step)))


async def publish_plan(
    store: Store,
    plan: SavePlan,
    limiter: anyio.CapacityLimiter,
    *,
    identity: WriterIdentity | None = None,
    chunk_bytes: int,
) -> Manifest:
    """Write, commit and publish ``plan`` (this process saves alone); return the
    manifest once it is durable.

    Every file has a name unique to this attempt (the plan's token), so
    concurrent or dead attempts at the same step never touch each other's files;
    the exclusive publish of the manifest alone decides which attempt is the
    checkpoint. Raises CheckpointExistsError if the step is already committed
    (before writing anything) or another writer publishes it first (after
    removing this attempt's files); StorageError on I/O failure; CheckpointError if
    a kept blob vanished and the snapshot holds no copy. ``identity`` (the
    writer's) is recorded in the manifest and told of the commit; files and blobs are
    written ``chunk_bytes`` per call (the writer's option).
    """
    step = plan.step
    await open_step(store, step, limiter)
    streamed: list[tuple[FileSink, FileEntry]] = []
    committed: list[FileEntry] = []
    blobs: dict[str, BlobEntry] = {}
    try:
        await write_files(
            store,
            step,
            plan.files,
            limiter,
            streamed=streamed,
            committed=committed,
            chunk_bytes=chunk_bytes,
            blobs=blobs,
        )
        manifest = manifest_of(plan, committed, blobs.values(), identity=identity)
        await publish_manifest(store, manifest, limiter)
    except BaseException as exc:
        why = shown(f"{type(exc).__name__}: {exc}")
        _log.debug("step %d: this attempt failed (%s); removing its files", step, why)
        with anyio.CancelScope(shield=True):
            await in_thread(limiter, clean_up, store, step, streamed, committed)
        raise
    await finish_commit(store, manifest, limiter, identity=identity)
    return manifest


def info_of(store: Store, manifest: Manifest) -> CheckpointInfo:
    """The CheckpointInfo of the checkpoint ``manifest`` committed in ``store``."""
    return CheckpointInfo.from_manifest(manifest, step_path(store, manifest.step))


def manifest_of(
    plan: SavePlan,
    files: Sequence[FileEntry],
    blobs: Iterable[BlobEntry] = (),
    *,
    identity: WriterIdentity | None,
    components: Mapping[str, ComponentEntry] | None = None,
    world_size: int = 1,
    per_rank: Mapping[str, list[str]] | None = None,
    shard_indexes: Sequence[str] = (),
) -> Manifest:
    """The manifest that commits ``plan`` once ``files`` are durable: the one way a save
    makes its manifest. ``blobs``: the entries of the shared blobs it uses, each once.
    ``components`` (default the plan's), ``world_size``, ``per_rank`` and
    ``shard_indexes`` (schema 4) are a many-rank save's merged ones. Any thread."""
    components = plan.components if components is None else components
    listed = sorted(blobs, key=lambda b: b.name)
    return Manifest(
        schema_version=schema_for(components, listed, indexed=bool(shard_indexes)),
        step=plan.step,
        created_at=plan.created_at,
        library_version=__version__,
        components=dict(components),
        files=sorted(files, key=lambda f: f.path),
        metrics=plan.metrics,
        metadata=plan.metadata,
        world_size=world_size,
        per_rank=dict(per_rank or {}),
        specs=plan.specs,
        writer="" if identity is None else identity.id,
        lineage="" if identity is None else identity.lineage,
        blobs=listed,
        shard_indexes=list(shard_indexes),
    )


async def finish_commit(
    store: Store,
    manifest: Manifest,
    limiter: anyio.CapacityLimiter,
    *,
    identity: WriterIdentity | None,
) -> None:
    """After this writer published ``manifest``: tell ``identity`` and sweep what earlier
    (dead) attempts left in the step's folder. Event loop."""
    if identity is not None:
        identity.note_commit(time.monotonic())
    listed = [f.path for f in manifest.files]
    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
        await in_thread(limiter, _sweep, store, step_dirname(manifest.step), listed)


def _sweep(store: Store, folder: str, listed: list[str]) -> None:
    """Remove what earlier (dead) attempts left in our just-committed ``folder``.

    Only files older than tunables.GC_OLDER_THAN go: a younger one may belong to a
    live attempt that lost and is removing its own files. Worker thread.
    """
    names = store.list_dir(folder)
    if set(names) <= {MANIFEST_NAME, *listed}:
        return
    old = unreferenced_files(store, folder, listed, names, older_than=tunables.GC_OLDER_THAN)
    remove_leftovers(store, old)


def clean_up(
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
