"""The catalog of a root: which steps are committed, and their manifests.

A step folder counts only if its manifest exists and decodes; folders without
one (saves in progress, crashed saves) are never listed. Blocking; any thread.
"""

from __future__ import annotations

import warnings

from checkpointd.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWarning,
    CorruptCheckpointError,
    StorageNotFoundError,
)
from checkpointd.layout import MANIFEST_NAME, parse_step_dirname, step_dirname
from checkpointd.manifest import CheckpointInfo, Manifest, decode_manifest
from checkpointd.storage import Store
from checkpointd.tunables import MAX_MANIFEST_BYTES

__all__ = ["CheckpointWarning", "committed", "read_manifest", "step_folders", "step_path"]


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
    if size > MAX_MANIFEST_BYTES:
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


def committed(store: Store, *, newest_first: bool = False) -> list[tuple[int, Manifest]]:
    """Every committed step with its manifest, ascending (or newest first).

    A manifest that exists but cannot be read (damaged, hostile, newer, or a
    storage error) is skipped with a CheckpointWarning: it costs only its own step.
    """
    found: list[tuple[int, Manifest]] = []
    for step in step_folders(store):
        try:
            found.append((step, read_manifest(store, step)))
        except CheckpointNotFoundError:
            continue
        except CheckpointError as exc:
            warnings.warn(f"skipping step {step}: {exc}", CheckpointWarning, stacklevel=2)
    if newest_first:
        found.reverse()
    return found


def infos(store: Store) -> list[CheckpointInfo]:
    """CheckpointInfo of every committed step, ascending by step."""
    return [CheckpointInfo.from_manifest(m, step_path(store, s)) for s, m in committed(store)]
