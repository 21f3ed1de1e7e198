"""Garbage collection of what crashed or failed saves leave behind.

``find_leftovers`` lists, without changing anything: step folders with no
manifest (saves that never committed), stray ``*.tmp-*`` files in committed
folders, stale commit leases, and incomplete multipart uploads under the root.
Only things no live writer owns are listed: nothing in them modified within
``older_than`` seconds, and no live lease on their folder. ``remove_leftovers``
removes them, re-checking that a folder is still uncommitted first. A committed
checkpoint is never listed. Blocking; call from any thread.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from checkpointd.catalog import step_folders
from checkpointd.errors import StorageError, StorageNotFoundError
from checkpointd.lease import LEASE_NAME, is_stale, read_lease
from checkpointd.manifest import MANIFEST_NAME, step_dirname
from checkpointd.storage import TEMP_MARKER, PendingUpload, Store

__all__ = ["DEFAULT_OLDER_THAN", "Leftover", "find_leftovers", "remove_leftovers"]

DEFAULT_OLDER_THAN = 3600.0
"""A suggested ``older_than`` for tools: an hour without a write means no writer is there."""

LeftoverKind = Literal["uncommitted", "temp", "lease", "upload"]


@dataclass(frozen=True, slots=True)
class Leftover:
    """One removable leftover: its kind, its path relative to the root, size and age."""

    kind: LeftoverKind
    path: str
    nbytes: int
    age: float
    """Seconds since anything in it was last modified."""
    upload: PendingUpload | None = None

    def describe(self) -> str:
        """One line for listings: kind, path, size and age."""
        return f"{self.kind:<11} {self.path}  {self.nbytes} bytes  {self.age:.0f} s old"


def _file_info(store: Store, path: str) -> tuple[int, float | None] | None:
    """(size, mtime) of ``path``, or None if it vanished or is not a regular file."""
    try:
        return store.size(path), store.modified(path)
    except StorageNotFoundError:
        return None
    except StorageError:
        return None


def _age(now: float, modified: float | None) -> float:
    # A store that cannot tell the time of a file gets age 0: never old enough.
    return 0.0 if modified is None else max(0.0, now - modified)


def _live_lease(store: Store, folder: str) -> bool:
    lease = read_lease(store, folder)
    return lease is not None and not is_stale(lease)


def _scan_folder(store: Store, step: int, older_than: float, now: float) -> list[Leftover]:
    folder = step_dirname(step)
    names = store.list_dir(folder)
    infos = {name: _file_info(store, f"{folder}/{name}") for name in names}
    if MANIFEST_NAME not in names:
        if _live_lease(store, folder):
            return []
        sizes = [i[0] for i in infos.values() if i is not None]
        ages = [_age(now, i[1]) for i in infos.values() if i is not None]
        # An empty folder (or one of only sub-folders) has no file to date; date it as old.
        age = min(ages, default=older_than)
        if age < older_than:
            return []
        return [Leftover("uncommitted", folder, sum(sizes), age)]
    found: list[Leftover] = []
    for name, info in infos.items():
        if info is None:
            continue
        age = _age(now, info[1])
        if age < older_than:
            continue
        if TEMP_MARKER in name:
            found.append(Leftover("temp", f"{folder}/{name}", info[0], age))
        elif name == LEASE_NAME and not _live_lease(store, folder):
            found.append(Leftover("lease", f"{folder}/{name}", info[0], age))
    return found


def find_leftovers(store: Store, *, older_than: float) -> list[Leftover]:
    """Everything under the root that crashed or failed saves left and no live writer owns.

    ``older_than``: seconds without a modification before a leftover counts as
    abandoned. Committed checkpoints are never listed. Changes nothing.
    """
    now = time.time()
    found: list[Leftover] = []
    for step in step_folders(store):
        found.extend(_scan_folder(store, step, older_than, now))
    uncommitted = {f.path for f in found if f.kind == "uncommitted"}
    for upload in store.pending_uploads():
        age = _age(now, upload.modified)
        if age < older_than:
            continue
        folder = upload.path.partition("/")[0]
        if folder not in uncommitted and _live_lease(store, folder):
            continue
        found.append(Leftover("upload", upload.path, 0, age, upload))
    return found


def remove_leftovers(store: Store, leftovers: Iterable[Leftover]) -> None:
    """Remove ``leftovers`` (from find_leftovers). A folder that got committed since is kept."""
    for leftover in leftovers:
        if leftover.kind == "upload":
            assert leftover.upload is not None
            store.abort_upload(leftover.upload)
        elif leftover.kind == "uncommitted":
            if store.exists(f"{leftover.path}/{MANIFEST_NAME}"):
                continue
            store.remove_dir(leftover.path)
        elif leftover.kind == "lease":
            folder = leftover.path.rpartition("/")[0]
            if not _live_lease(store, folder):
                store.remove_file(leftover.path)
        else:
            store.remove_file(leftover.path)
