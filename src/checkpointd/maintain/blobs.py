"""The shared blob area of incremental checkpoints: pins, and reference-aware deletion.

Blobs (``blobs/NAME``) hold the bytes of tensors that many checkpoints share;
a save in flight names the blobs it may reference in a pin
(``pins/{step}.{token}.json``) before it writes anything. A blob is deleted only
when no committed manifest lists it and no pin names it; a pass reads the pins
first and the manifests after, so a save that commits (and drops its pin)
during the pass is seen by one or the other. Deletion always comes after the
manifests of the dropped checkpoints are gone, so a crash midway leaves only
orphans, which gc removes once they are old. docs/format.md ("Shared tensor
data") is the spec. Blocking; worker threads or any thread. Imports no torch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from checkpointd import tunables
from checkpointd.errors import CheckpointError, CheckpointNotFoundError, StorageError
from checkpointd.format.checksum import BytesLike
from checkpointd.format.layout import BLOBS_DIR, PINS_DIR, blob_path, is_blob_name, step_dirname
from checkpointd.format.manifest import BlobEntry, Manifest
from checkpointd.read import catalog
from checkpointd.storage import Store

__all__ = [
    "Orphan",
    "Pin",
    "blob_stored",
    "drop_blobs",
    "find_orphans",
    "newest_blobs",
    "read_pins",
    "remove_pin",
    "write_blob",
    "write_pin",
]


def newest_blobs(store: Store) -> dict[str, BlobEntry]:
    """The blobs of the newest committed checkpoint (none if there is none). Worker thread."""
    try:
        _, manifest = catalog.newest(store, on_damaged=lambda step, exc: None)
    except CheckpointNotFoundError:
        return {}
    return {blob.name: blob for blob in manifest.blobs}


def write_blob(store: Store, name: str, data: BytesLike, chunk_bytes: int) -> BlobEntry:
    """Write blob ``name`` durably (atomic replace: same name, same bytes), ``chunk_bytes``
    per write. No CRC32C: the name is the digest readers check. Worker thread."""
    view = memoryview(data).cast("B")
    sink = store.open_file(blob_path(name), size=len(view))
    try:
        for start in range(0, len(view), chunk_bytes):
            sink.write(view[start : start + chunk_bytes])
        sink.commit()
    except BaseException:
        sink.discard()
        raise
    return BlobEntry(name, len(view), written=True)


def blob_stored(store: Store, entry: BlobEntry) -> bool:
    """True if blob ``entry`` is stored with its size. Worker thread."""
    try:
        return store.size(blob_path(entry.name)) == entry.size
    except StorageError:
        return False


class Pin(msgspec.Struct, frozen=True):
    """What a pin file holds: the saving step and the blobs it may reference."""

    step: int
    blobs: list[str]


def write_pin(store: Store, step: int, token: str, blobs: Iterable[str]) -> str:
    """Publish a pin naming ``blobs`` for the save of ``step`` (attempt ``token``); return
    its path. Durable before it returns. Worker thread."""
    path = f"{PINS_DIR}/{step_dirname(step)}.{token}.json"
    store.make_dir(PINS_DIR)
    sink = store.open_file(path)
    try:
        sink.write(msgspec.json.encode(Pin(step, sorted(blobs))))
    except BaseException:
        sink.discard()
        raise
    sink.commit()
    store.sync_dir(PINS_DIR)
    return path


def remove_pin(store: Store, path: str) -> None:
    """Remove a pin once its save is published or failed (best effort). Worker thread."""
    with contextlib.suppress(StorageError):
        store.remove_file(path)


def _pins(store: Store) -> list[tuple[str, float | None, Pin | None]]:
    """(path, modified, pin or None if unreadable) of every pin file."""
    found: list[tuple[str, float | None, Pin | None]] = []
    for name in store.list_dir(PINS_DIR):
        if not name.endswith(".json"):
            continue  # a temporary of a pin being written
        path = f"{PINS_DIR}/{name}"
        try:
            modified = store.modified(path) if store.capabilities.modification_times else None
            data = store.read_bytes(path, 0, min(store.size(path), tunables.MAX_MANIFEST_BYTES))
        except StorageError:
            continue  # removed since the listing: its save is published or gone
        try:
            pin: Pin | None = msgspec.json.decode(data, type=Pin)
        except msgspec.DecodeError:
            pin = None
        found.append((path, modified, pin))
    return found


def read_pins(store: Store) -> set[str] | None:
    """Every blob some pin names; None if a pin cannot be read (then nothing may be deleted).

    Call before reading the manifests of the same pass. Worker thread."""
    pinned: set[str] = set()
    for _, _, pin in _pins(store):
        if pin is None:
            return None
        pinned.update(pin.blobs)
    return pinned


def drop_blobs(
    store: Store, dropped: Iterable[Manifest], known: dict[int, Manifest] | None = None
) -> list[str]:
    """Delete the blobs of the ``dropped`` checkpoints (whose manifests are already
    deleted) that no committed manifest lists and no pin names; return their names.

    Reads the pins, then every manifest; deletes nothing if a pin or a manifest
    cannot be read (a damaged one may list them): gc removes them later. ``known``:
    manifests read before (catalog.scan). Worker thread.
    """
    candidates = {blob.name for manifest in dropped for blob in manifest.blobs}
    if not candidates:
        return []
    pinned = read_pins(store)
    if pinned is None:
        return []
    damaged: list[int] = []
    kept = _listed(store, damaged, known)
    if damaged:
        return []
    doomed = sorted(candidates - kept - pinned)
    for name in doomed:
        store.remove_file(blob_path(name))
    return doomed


def _listed(store: Store, damaged: list[int], known: dict[int, Manifest] | None = None) -> set[str]:
    """Every blob a committed manifest lists; steps whose manifest cannot be read go to
    ``damaged``."""

    def note(step: int, _exc: CheckpointError) -> None:
        damaged.append(step)

    return {
        blob.name
        for _, manifest in catalog.scan(store, newest_first=False, on_damaged=note, known=known)
        for blob in manifest.blobs
    }


@dataclass(frozen=True, slots=True)
class Orphan:
    """A blob no manifest lists and no live pin names, or a pin of a dead save."""

    kind: str
    """"blob" or "pin"."""
    path: str
    nbytes: int
    age: float


def find_orphans(store: Store, *, older_than: float) -> tuple[list[Orphan], list[str]]:
    """Blobs and pins untouched for ``older_than`` seconds that nothing needs, and one
    line per reason nothing could be judged. Changes nothing. Worker thread.

    A pin older than ``older_than`` belongs to a dead save (a live one drops its pin
    when it publishes) and pins nothing. No blob is listed while a pin or a
    manifest cannot be read.
    """
    now = time.time()
    blobs = [n for n in store.list_dir(BLOBS_DIR) if is_blob_name(n)]
    pins = _pins(store) if blobs or store.list_dir(PINS_DIR) else []
    orphans: list[Orphan] = []
    pinned: set[str] = set()
    problems: list[str] = []
    for path, modified, pin in pins:
        age = 0.0 if modified is None else max(0.0, now - modified)
        if age >= older_than:
            orphans.append(Orphan("pin", path, 0, age))
        elif pin is None:
            problems.append(f"unreadable pin {path}: no blob is removed")
        else:
            pinned.update(pin.blobs)
    if not blobs or problems:
        return orphans, problems
    damaged: list[int] = []
    kept = _listed(store, damaged) | pinned
    if damaged:
        steps = ", ".join(map(str, damaged))
        return orphans, [f"unreadable manifest at step {steps}: no blob is removed"]
    for name in blobs:
        if name in kept:
            continue
        path = blob_path(name)
        try:
            size = store.size(path)
            modified = store.modified(path) if store.capabilities.modification_times else None
        except StorageError:
            continue
        age = 0.0 if modified is None else max(0.0, now - modified)
        if age >= older_than:
            orphans.append(Orphan("blob", path, size, age))
    return orphans, problems
