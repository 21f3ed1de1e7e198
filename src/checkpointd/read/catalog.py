"""The catalog of a root: which steps are committed, and their manifests.

A step folder counts only if its manifest exists and decodes; folders without
one (saves in progress, crashed saves) are never listed. ``scan`` is the one
walk over a root's checkpoints: one listing, then manifests read lazily in step
order, so a caller that wants the newest stops after one read. Blocking; any
thread. Imports no torch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from checkpointd import tunables
from checkpointd.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWarning,
    CorruptCheckpointError,
    StorageNotFoundError,
)
from checkpointd.format.layout import MANIFEST_NAME, parse_step_dirname, step_dirname
from checkpointd.format.manifest import CheckpointInfo, Manifest, decode_manifest
from checkpointd.storage import Store, open_store

__all__ = [
    "CheckpointWarning",
    "committed",
    "infos",
    "list_checkpoints",
    "newest",
    "read_manifest",
    "resolve",
    "scan",
    "step_folders",
    "step_path",
]

OnDamaged = Callable[[int, CheckpointError], None]
"""Called with (step, error) for a manifest that exists but cannot be read."""


def step_path(store: Store, step: int) -> str:
    """The user-facing location of a step's folder (for messages and CheckpointInfo.path)."""
    return f"{store.url.rstrip('/')}/{step_dirname(step)}"


def step_folders(store: Store) -> list[int]:
    """Steps that have a folder under the root, committed or not, ascending."""
    return sorted(s for s in map(parse_step_dirname, store.list_dir("")) if s is not None)


def read_manifest(store: Store, step: int) -> Manifest:
    """Read and check the manifest of ``step``.

    Raises CheckpointNotFoundError if the step has no manifest, CorruptCheckpointError
    if it is damaged or names another step, IncompatibleCheckpointError if newer.
    """
    path = f"{step_dirname(step)}/{MANIFEST_NAME}"
    where = f"{step_path(store, step)}/{MANIFEST_NAME}"
    try:
        size = store.size(path)
    except StorageNotFoundError:
        raise CheckpointNotFoundError(f"step {step} is not committed under {store.url}") from None
    if size > tunables.MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{where}: {size} bytes is too large for a manifest")
    try:
        data = store.read_bytes(path, 0, size)
    except StorageNotFoundError:
        # Deleted (by retention or gc) since the size call: no longer committed.
        raise CheckpointNotFoundError(f"step {step} is not committed under {store.url}") from None
    manifest = decode_manifest(data, where=where)
    if manifest.step != step:
        raise CorruptCheckpointError(f"{where}: manifest is for step {manifest.step}, not {step}")
    return manifest


def warn_damaged(step: int, error: CheckpointError) -> None:
    """The default for a damaged manifest: skip its step with a CheckpointWarning."""
    warnings.warn(f"skipping step {step}: {error}", CheckpointWarning, stacklevel=3)


def raise_damaged(step: int, error: CheckpointError) -> None:
    """For tools that should show damage rather than skip it: raise the error."""
    raise error


def scan(
    store: Store,
    *,
    newest_first: bool = True,
    on_damaged: OnDamaged = warn_damaged,
    known: dict[int, Manifest] | None = None,
) -> Iterator[tuple[int, Manifest]]:
    """Yield (step, manifest) of every committed step, newest first (or ascending).

    One listing of the root; each manifest is read only when the caller asks for
    the next item, so stopping after the first costs one manifest read when the
    newest is intact. A folder without a manifest is skipped silently; a manifest
    that exists but cannot be read (damaged, hostile, newer, a storage error) goes
    to ``on_damaged`` (default: a CheckpointWarning) and costs only its own step.

    A pass that found nothing and met a step whose manifest is missing lists the root
    again (that step may have been deleted after a newer one committed, see below).

    ``known``: manifests read by earlier scans of this root, reused instead of read
    again (a committed manifest never changes) and updated in place; steps no longer
    listed are dropped from it. A writer passes one, so its retention pass reads only
    the manifests committed since its last pass.
    """
    for _ in range(tunables.CATALOG_PASSES):
        steps = step_folders(store)
        found, vanished = False, False
        if known is not None:
            for gone in known.keys() - set(steps):
                del known[gone]
        for step in reversed(steps) if newest_first else steps:
            if known is not None and step in known:
                found = True
                yield step, known[step]
                continue
            try:
                manifest = read_manifest(store, step)
            except CheckpointNotFoundError:
                vanished = True
                continue
            except CheckpointError as exc:
                on_damaged(step, exc)
                continue
            if known is not None:
                known[step] = manifest
            found = True
            yield step, manifest
        # A listed step without a manifest is in progress, or was deleted since the
        # listing (retention deletes one only after a newer one commits): with nothing
        # found, list again, or a reader could miss a root that always had a checkpoint.
        if found or not vanished:
            return


def newest(store: Store, *, on_damaged: OnDamaged = warn_damaged) -> tuple[int, Manifest]:
    """(step, manifest) of the newest committed step; CheckpointNotFoundError if none."""
    for found in scan(store, on_damaged=on_damaged):
        return found
    raise CheckpointNotFoundError(
        f"no committed checkpoint under {store.url}; save one first or check the path"
    )


def resolve(
    store: Store, step: int | None, *, on_damaged: OnDamaged = warn_damaged
) -> tuple[int, Manifest]:
    """(step, manifest) of ``step``, or of the newest committed step when it is None."""
    if step is not None:
        return step, read_manifest(store, step)
    return newest(store, on_damaged=on_damaged)


def committed(
    store: Store, *, newest_first: bool = False, known: dict[int, Manifest] | None = None
) -> list[tuple[int, Manifest]]:
    """Every committed step with its manifest, ascending (or newest first); see ``scan``."""
    return list(scan(store, newest_first=newest_first, known=known))


def infos(store: Store) -> list[CheckpointInfo]:
    """CheckpointInfo of every committed step, ascending by step (reads every manifest)."""
    return [
        CheckpointInfo.from_manifest(m, step_path(store, s))
        for s, m in scan(store, newest_first=False)
    ]


def list_checkpoints(
    root: str, *, storage_options: Mapping[str, Any] | None = None
) -> list[CheckpointInfo]:
    """Every committed checkpoint under ``root``, ascending by step.

    Args:
        root: A local path or fsspec URL (``s3://bucket/run``...).
        storage_options: fsspec options for ``root`` (credentials, endpoint...).

    Returns:
        The CheckpointInfo of each committed checkpoint; empty if there is none.

    Raises:
        StorageError: The storage could not be listed or read.
    """
    store = open_store(str(root), storage_options)
    try:
        return infos(store)
    finally:
        store.close()
