"""Removing a whole checkpoint root, crash-safely, and finishing a removal a crash cut short.

The Lightning plugin deletes a root (``dirpath/epoch=1-step=100.ckpt``) when
``ModelCheckpoint`` drops it, once every save made before is committed. Two
rules make that safe against ``kill -9``:

- ``delete_root`` deletes through the one deletion rule of retention.py: each
  checkpoint manifest first, then its files, then the shared blobs no
  remaining manifest or pin needs (blobs.py), then the rest, through the
  root's Store (local disk and S3 alike). A kill midway leaves at most folders
  without a manifest, which no reader lists or loads: never a torn checkpoint.
- Before the deletion is even due, ``mark_removal`` publishes the intent at
  the root (``removing.json``, written like every other file: temp file,
  fsync, rename; one PUT on S3) with the saves it waits for, as (root, step)
  pairs. A removal a kill interrupted is finished by the next run's plugin or
  by ``checkpointd gc --apply``, once each of those roots has committed that
  step or a newer one (``due``); until then the root is kept, as the plugin
  would have kept it. A root saved to again drops its marker (``unmark``).

Blocking; any thread. Imports no torch.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from checkpointd import tunables
from checkpointd.errors import CheckpointError, StorageError
from checkpointd.format.layout import BLOBS_DIR, PINS_DIR, parse_step_dirname, step_dirname
from checkpointd.maintain.deletion import delete_checkpoints
from checkpointd.read import catalog
from checkpointd.storage import Store, open_store

__all__ = [
    "MARKER_NAME",
    "Awaited",
    "Removal",
    "delete_root",
    "due",
    "finish_removals",
    "mark_removal",
    "mark_root",
    "pending_removals",
    "read_removal",
    "remove_root",
    "unmark",
    "unmark_root",
]

MARKER_NAME = "removing.json"
"""The file at a root that says the root is being removed."""


class Awaited(msgspec.Struct, frozen=True):
    """A save the removal waits for: root (path or URL) and step."""

    root: str
    step: int


class Removal(msgspec.Struct, frozen=True):
    """What a removal marker holds: the saves that must be committed before it runs."""

    after: list[Awaited] = msgspec.field(default_factory=list)


def mark_removal(store: Store, after: Iterable[Awaited]) -> bool:
    """Publish the removal marker at ``store``'s root (replacing one there); False (and
    nothing written) if the root holds nothing. Durable when it returns."""
    if not store.list_dir(""):
        return False
    sink = store.open_file(MARKER_NAME)
    try:
        sink.write(msgspec.json.encode(Removal(list(after))))
    except BaseException:
        sink.discard()
        raise
    sink.commit()
    store.sync_dir("")
    return True


def read_removal(store: Store) -> Removal | None:
    """The removal marker at ``store``'s root; None if there is none. An unreadable one
    (it is published whole, so only a hostile one) waits for nothing."""
    try:
        if not store.exists(MARKER_NAME):
            return None
        data = store.read_bytes(
            MARKER_NAME, 0, min(store.size(MARKER_NAME), tunables.MAX_MANIFEST_BYTES)
        )
    except StorageError:
        return None
    try:
        return msgspec.json.decode(data, type=Removal)
    except msgspec.DecodeError:
        return Removal()


def unmark(store: Store) -> None:
    """Drop the removal marker at ``store``'s root: the root is wanted again."""
    store.remove_file(MARKER_NAME)


def mark_root(
    root: str, after: Iterable[Awaited], storage_options: Mapping[str, Any] | None = None
) -> bool:
    """``mark_removal`` at the root at path or URL ``root``; False if nothing is there."""
    if "://" not in root and not os.path.isdir(root):
        return False
    store = open_store(root, storage_options)
    try:
        return mark_removal(store, after)
    finally:
        store.close()


def unmark_root(root: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """``unmark`` at the root at path or URL ``root``."""
    store = open_store(root, storage_options)
    try:
        unmark(store)
    finally:
        store.close()


def delete_root(store: Store) -> None:
    """Delete everything under ``store``'s root, never leaving a torn checkpoint: the
    committed checkpoints manifest first (deletion.delete_checkpoints, shared blobs
    reference-aware), then the rest, then the root itself (the marker with it).

    Call only once no save into the root is in flight."""
    delete_checkpoints(store, [step for step, _ in catalog.committed(store)])
    for step in catalog.step_folders(store):  # what this root's finished saves left
        store.remove_dir(step_dirname(step))
    store.remove_dir(BLOBS_DIR)
    store.remove_dir(PINS_DIR)
    store.remove_dir("")


def remove_root(root: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """``delete_root`` on the root at path or URL ``root``."""
    store = open_store(root, storage_options)
    try:
        delete_root(store)
    finally:
        store.close()


def due(removal: Removal, storage_options: Mapping[str, Any] | None = None) -> bool:
    """True if every save ``removal`` waits for is committed (its root has that step or a
    newer one committed)."""
    for awaited in removal.after:
        try:
            infos = catalog.list_checkpoints(awaited.root, storage_options=storage_options)
        except CheckpointError:
            return False
        if not infos or infos[-1].step < awaited.step:
            return False
    return True


def pending_removals(
    folder: str, storage_options: Mapping[str, Any] | None = None
) -> list[tuple[str, Removal]]:
    """(root, marker) of each root with a removal marker: ``folder`` itself and the
    folders directly in it (a Lightning ``dirpath``). Changes nothing."""
    base = folder.rstrip("/") or folder
    store = open_store(base, storage_options)
    try:
        found: list[tuple[str, Removal]] = []
        own = read_removal(store)
        if own is not None:
            found.append((base, own))
        for name in store.list_dir(""):
            if name == MARKER_NAME or parse_step_dirname(name) is not None:
                continue
            if "://" not in base and os.path.islink(os.path.join(base, name)):
                continue  # save_last="link": the root it names is listed under its own name
            with contextlib.suppress(StorageError):
                if not store.exists(f"{name}/{MARKER_NAME}"):
                    continue
                child = open_store(f"{base}/{name}", storage_options)
                try:
                    removal = read_removal(child)
                finally:
                    child.close()
                if removal is not None:
                    found.append((f"{base}/{name}", removal))
        return found
    finally:
        store.close()


def finish_removals(
    folder: str, storage_options: Mapping[str, Any] | None = None, *, apply: bool
) -> list[str]:
    """``gc``'s part: one line per interrupted removal in ``folder`` (see
    ``pending_removals``); the due ones are finished when ``apply``."""
    lines: list[str] = []
    for root, removal in pending_removals(folder, storage_options):
        if due(removal, storage_options):
            if apply:
                remove_root(root, storage_options)
            lines.append(f"  remove  {root}  (the saves its removal waited for are committed)")
        else:
            waits = ", ".join(f"{a.root} step {a.step}" for a in removal.after)
            lines.append(f"  keep    {root}  (its removal waits for {waits})")
    return lines
