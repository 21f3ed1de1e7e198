"""Verifying a committed step: every file streamed through CRC32C and every shared blob
through XXH3-128, against the manifest (sizes first), in constant memory; then a schema 4
step's shard indexes checked as ``load`` checks them (read/indexes.py). No torch.
Blocking; any thread."""

from __future__ import annotations

from collections.abc import Callable

from checkpointd import tunables
from checkpointd.errors import StorageNotFoundError
from checkpointd.format.checksum import crc32c
from checkpointd.format.layout import blob_path, step_dirname
from checkpointd.format.manifest import BlobEntry, FileEntry, Manifest
from checkpointd.read import catalog
from checkpointd.read.reader import StepReader
from checkpointd.storage import Store

__all__ = ["Progress", "verify_blob", "verify_file", "verify_step"]

Progress = Callable[[int], None]
"""Called with the number of bytes just read (from the reading thread)."""


def verify_step(
    store: Store,
    step: int,
    manifest: Manifest,
    progress: Progress | None = None,
    *,
    seen: dict[tuple[str, int], str | None] | None = None,
) -> list[str]:
    """Check every file and shared blob of a committed step (sizes, CRC32C of files,
    XXH3-128 of blobs against their names), then, if its index files are intact, its
    shard indexes against the manifest (``ShardIndexes.problems``, what ``load``
    refuses); one line per bad file, blob or index.

    ``seen`` caches blob results across calls (a blob shared by many checkpoints is
    read once); a bad blob is reported again for every checkpoint that uses it.
    """
    where = catalog.step_path(store, step)
    bad: list[str] = []
    intact = True
    for entry in manifest.files:
        problem = verify_file(store, step, entry, progress)
        if problem is not None:
            bad.append(f"{where}/{entry.path}: {problem}")
            intact = intact and entry.path not in manifest.shard_indexes
    if manifest.shard_indexes and intact:
        bad += StepReader(store, step, manifest).indexes.problems()
    for blob in manifest.blobs:
        key = (blob.name, blob.size)
        if seen is not None and key in seen:
            problem = seen[key]
        else:
            problem = verify_blob(store, blob, progress)
            if seen is not None:
                seen[key] = problem
        if problem is not None:
            bad.append(f"{store.url.rstrip('/')}/{blob_path(blob.name)} (shared): {problem}")
    return bad


def verify_file(
    store: Store, step: int, entry: FileEntry, progress: Progress | None = None
) -> str | None:
    """Stream every byte of one file through CRC32C; what is wrong with it, or None.

    Reads in ``tunables.READ_CHUNK_BYTES`` pieces (constant memory), calling ``progress`` after each.
    """
    path = f"{step_dirname(step)}/{entry.path}"
    return _verify_path(store, path, entry.size, entry.crc32c, progress)


def verify_blob(store: Store, entry: BlobEntry, progress: Progress | None = None) -> str | None:
    """As ``verify_file``, for a shared blob the checkpoint uses: its bytes must hash
    (XXH3-128) to its name."""
    return _verify_path(store, blob_path(entry.name), entry.size, entry.name, progress)


def _verify_path(
    store: Store, path: str, expected_size: int, expected: int | str, progress: Progress | None
) -> str | None:
    """Size, then CRC32C (``expected`` an int) or blob name (a str) of ``path``."""
    from checkpointd.format.digest import BlobHasher

    hasher = BlobHasher() if isinstance(expected, str) else None
    try:
        size = store.size(path)
        if size != expected_size:
            return f"size {size} does not match the manifest's {expected_size}"
        chunk = tunables.READ_CHUNK_BYTES
        buffer = bytearray(min(chunk, size))
        digest = 0
        for offset in range(0, size, chunk):
            view = memoryview(buffer)[: min(chunk, size - offset)]
            store.read_into(path, view, offset)
            if hasher is not None:
                hasher.update(view)
            else:
                digest = crc32c(view, digest)
            if progress is not None:
                progress(len(view))
    except StorageNotFoundError:
        return "listed in the manifest but missing"
    if hasher is not None:
        name = hasher.name()
        return None if name == expected else f"its bytes hash to {name}, not its name"
    if digest != expected:
        return f"CRC32C {digest:08x} does not match the manifest's {expected:08x}"
    return None
