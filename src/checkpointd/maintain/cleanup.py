"""Garbage collection of what crashed, failed or losing saves leave behind.

Every save attempt writes files under names of its own (commit.py), so nothing
a dead writer left can collide with a live one; leftovers are found by age
alone. ``scan_leftovers`` lists, without changing anything: step folders with
no manifest (saves that never committed), ``*.tmp-*`` files and files the
manifest does not reference in committed folders (a losing or dead attempt's
files, ``writer.lock`` of older versions), shared blobs no manifest uses and pins
of dead saves (shared.find_orphans), and incomplete multipart uploads under the root. Only what nothing has modified for ``older_than`` seconds is
listed, so a live save (or a losing one still cleaning up) is never raced; a
step folder is dated by its own modification time as well as by its files.
What it cannot list it skips and names in ``problems``. ``remove_leftovers``
removes them, re-checking that a folder is still uncommitted first. A
committed checkpoint (its manifest and the files it lists) is never listed.
Blocking; call from any thread.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from checkpointd.errors import CheckpointError, StorageError
from checkpointd.format.layout import MANIFEST_NAME, is_temp_name, step_dirname
from checkpointd.maintain.blobs import find_orphans
from checkpointd.read.catalog import read_manifest, step_folders
from checkpointd.storage import PendingUpload, Store

__all__ = [
    "Leftover",
    "LeftoverScan",
    "find_leftovers",
    "remove_leftovers",
    "scan_leftovers",
    "unreferenced_files",
]

LeftoverKind = Literal["uncommitted", "temp", "unreferenced", "upload", "blob", "pin"]


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


@dataclass(frozen=True, slots=True)
class LeftoverScan:
    """What ``scan_leftovers`` found, and one line for each thing it could not list."""

    leftovers: list[Leftover] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _file_info(store: Store, path: str) -> tuple[int, float | None] | None:
    """(size, mtime) of ``path``, or None if it vanished or is not a regular file."""
    try:
        dated = store.capabilities.modification_times
        return store.size(path), (store.modified(path) if dated else None)
    except StorageError:
        return None


def _folder_time(store: Store, folder: str) -> float | None:
    """The modification time of ``folder`` itself, if the store keeps one (local folders)."""
    if not store.capabilities.folders:
        return None  # folders are implicit prefixes: their files date them
    try:
        return store.modified(folder)
    except StorageError:
        return None  # object stores have no folders: their files date them


def _age(now: float, modified: float | None) -> float:
    # A store that cannot tell the time of a file gets age 0: never old enough.
    return 0.0 if modified is None else max(0.0, now - modified)


def unreferenced_files(
    store: Store,
    folder: str,
    listed: Iterable[str],
    names: Iterable[str],
    *,
    older_than: float,
    now: float | None = None,
) -> list[Leftover]:
    """Files among ``names`` in committed ``folder`` that are temporaries or not in ``listed``
    (its manifest's files), untouched for ``older_than`` seconds. Changes nothing."""
    keep = {MANIFEST_NAME, *listed}
    now = time.time() if now is None else now
    found: list[Leftover] = []
    for name in names:
        if name in keep:
            continue
        info = _file_info(store, f"{folder}/{name}")
        if info is None:
            continue  # gone, or a sub-folder: not ours to judge
        age = _age(now, info[1])
        if age >= older_than:
            kind: LeftoverKind = "temp" if is_temp_name(name) else "unreferenced"
            found.append(Leftover(kind, f"{folder}/{name}", info[0], age))
    return found


def _scan_folder(store: Store, step: int, older_than: float, now: float) -> list[Leftover]:
    folder = step_dirname(step)
    names = store.list_dir(folder)
    if MANIFEST_NAME in names:
        try:
            listed = [f.path for f in read_manifest(store, step).files]
        except CheckpointError:
            # Unreadable (or deleted by retention just now): judge only what is surely not
            # the checkpoint's.
            names = [n for n in names if is_temp_name(n)]
            listed = []
        return unreferenced_files(store, folder, listed, names, older_than=older_than, now=now)
    infos = [_file_info(store, f"{folder}/{name}") for name in names]
    sizes = [i[0] for i in infos if i is not None]
    times = [i[1] for i in infos if i is not None]
    # The folder's own time covers a save between its mkdir and its first file.
    folder_time = _folder_time(store, folder)
    if folder_time is not None:
        times.append(folder_time)
    # A folder with nothing to date it by (object stores list no empty folders) is old.
    age = min((_age(now, t) for t in times), default=older_than)
    if age < older_than:
        return []
    return [Leftover("uncommitted", folder, sum(sizes), age)]


def scan_leftovers(store: Store, *, older_than: float) -> LeftoverScan:
    """Everything under the root that crashed or failed saves left, untouched for
    ``older_than`` seconds, and what could not be listed. Changes nothing.

    Raises StorageError only if the root itself cannot be listed.
    """
    now = time.time()
    scan = LeftoverScan()
    for step in step_folders(store):
        try:
            scan.leftovers.extend(_scan_folder(store, step, older_than, now))
        except StorageError as exc:
            scan.problems.append(f"could not scan step folder {step_dirname(step)}: {exc}")
    try:
        orphans, problems = find_orphans(store, older_than=older_than)
    except StorageError as exc:
        orphans, problems = [], [f"could not scan shared blobs, so none are removed: {exc}"]
    scan.problems.extend(problems)
    for orphan in orphans:
        kind: LeftoverKind = "blob" if orphan.kind == "blob" else "pin"
        scan.leftovers.append(Leftover(kind, orphan.path, orphan.nbytes, orphan.age))
    try:
        uploads = store.pending_uploads()
    except StorageError as exc:
        scan.problems.append(f"could not list incomplete uploads, so none are removed: {exc}")
        uploads = []
    for upload in uploads:
        age = _age(now, upload.modified)
        if age >= older_than:
            scan.leftovers.append(Leftover("upload", upload.path, 0, age, upload))
    return scan


def find_leftovers(store: Store, *, older_than: float) -> list[Leftover]:
    """The leftovers of ``scan_leftovers``; what could not be listed is skipped silently."""
    return scan_leftovers(store, older_than=older_than).leftovers


def remove_leftovers(store: Store, leftovers: Iterable[Leftover]) -> None:
    """Remove ``leftovers`` (from find_leftovers). A folder that got committed since is kept."""
    for leftover in leftovers:
        if leftover.kind == "upload":
            assert leftover.upload is not None
            store.abort_upload(leftover.upload)
        elif leftover.kind == "blob":
            # A save may have written the same bytes again since the scan: then it is
            # younger now than it was then, and it stays.
            modified = _file_info(store, leftover.path)
            if modified is None or _age(time.time(), modified[1]) < leftover.age:
                continue
            store.remove_file(leftover.path)
        elif leftover.kind == "uncommitted":
            if store.exists(f"{leftover.path}/{MANIFEST_NAME}"):
                continue
            store.remove_dir(leftover.path)
        else:
            store.remove_file(leftover.path)
