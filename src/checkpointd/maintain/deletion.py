"""Deleting committed checkpoints: each manifest first, then the blobs only they used.

The one deletion rule, shared by retention (retention.py), ``newer_steps="discard"``,
gc and root removal: a checkpoint whose manifest is gone is not a checkpoint, so one
cut short is never seen half-deleted, only left over for gc. Blocking storage calls;
any thread.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from checkpointd.format.layout import MANIFEST_NAME, step_dirname
from checkpointd.format.manifest import Manifest
from checkpointd.storage import Store
from checkpointd.storage.base import shown

__all__ = ["delete_checkpoint", "delete_checkpoints"]

_log = logging.getLogger(__name__)


def delete_checkpoint(store: Store, step: int) -> bool:
    """Remove the committed checkpoint ``step``, its manifest first.

    A step without a manifest is left alone: its folder may be a save in flight, which
    only gc may remove once it is old. Once the manifest is gone the folder is not a
    checkpoint: if removing the rest fails or the process dies, what is left is a
    leftover for gc, which no reader lists or loads. Blocking; any thread.

    Args:
        store: The root's store.
        step: The step to delete.

    Returns:
        True if ``step`` had a manifest and was deleted; False if it had none (nothing
        is touched).

    Raises:
        StorageError: The storage fails.
    """
    folder = step_dirname(step)
    manifest = f"{folder}/{MANIFEST_NAME}"
    if not store.exists(manifest):
        return False
    store.remove_file(manifest)
    _log.debug("step %d of %s: manifest deleted, removing its folder", step, shown(store.url))
    store.remove_dir(folder)
    return True


def delete_checkpoints(
    store: Store,
    steps: Iterable[int],
    manifests: Mapping[int, Manifest] | None = None,
    known: dict[int, Manifest] | None = None,
) -> list[int]:
    """``delete_checkpoint`` each of ``steps`` in order, then the blobs only they used.

    The shared blobs go after their manifests (blobs.drop_blobs), so a crash midway
    loses nothing a committed checkpoint needs. Blocking; any thread.

    Args:
        store: The root's store.
        steps: The steps to delete, in the order to delete them.
        manifests: Those of ``steps`` already read (the others are read here; an
            unreadable one's blobs are left to gc).
        known: A manifest cache (catalog.scan), kept up to date.

    Returns:
        The steps deleted (those that had a manifest).

    Raises:
        StorageError: The storage fails.
    """
    from checkpointd.errors import CheckpointError
    from checkpointd.maintain.blobs import drop_blobs
    from checkpointd.read.catalog import read_manifest

    deleted: list[int] = []
    dropped: list[Manifest] = []
    for step in steps:
        manifest = (manifests or {}).get(step)
        if manifest is None:
            try:
                manifest = read_manifest(store, step)
            except CheckpointError:
                manifest = None  # unreadable: its blobs, if any, are left to gc
        if delete_checkpoint(store, step):
            deleted.append(step)
            if manifest is not None:
                dropped.append(manifest)
    drop_blobs(store, dropped, known)
    return deleted
