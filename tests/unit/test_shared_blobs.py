"""Shared blobs (incremental saves): manifest checks of refs and blob names, pins, and
gc's re-check before removing an orphan blob."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest
import torch

import checkpointd
from checkpointd import tunables
from checkpointd.errors import CorruptCheckpointError
from checkpointd.format.layout import blob_path, is_blob_name
from checkpointd.format.manifest import (
    BlobEntry,
    BlobRef,
    ComponentEntry,
    FileEntry,
    Manifest,
    decode_manifest,
    encode_manifest,
)
from checkpointd.maintain.blobs import drop_blobs, read_pins, remove_pin, write_pin
from checkpointd.maintain.cleanup import remove_leftovers, scan_leftovers
from checkpointd.read.catalog import read_manifest
from checkpointd.storage import LocalStore

BLOB = "xxh128-" + "0123456789abcdef" * 2


def _manifest(**changes: object) -> Manifest:
    base = Manifest(
        schema_version=2,
        step=3,
        created_at=datetime(2026, 1, 2, tzinfo=UTC),
        library_version="0.1.0",
        components={
            "model": ComponentEntry(
                "model.tree.msgpack", [], 64, 1, refs={"w": BlobRef(BLOB, "F32", [4, 4])}
            )
        },
        files=[FileEntry("model.tree.msgpack", 10, 7)],
        blobs=[BlobEntry(BLOB, 64, written=True)],
    )
    return msgspec.structs.replace(base, **changes)


def test_a_manifest_with_refs_round_trips_and_counts_its_bytes() -> None:
    manifest = decode_manifest(encode_manifest(_manifest()))
    assert manifest.components["model"].refs["w"].blob == BLOB
    assert manifest.nbytes == 10 + 64
    assert manifest.referenced_nbytes == 0
    referencing = _manifest(blobs=[BlobEntry(BLOB, 64, written=False)])
    assert decode_manifest(encode_manifest(referencing)).referenced_nbytes == 64


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"blobs": []}, "unlisted blob"),
        ({"blobs": [BlobEntry("../../etc/passwd", 64)]}, "invalid blob entry"),
        ({"blobs": [BlobEntry(BLOB.upper(), 64)]}, "invalid blob entry"),
        ({"blobs": [BlobEntry(BLOB, 64), BlobEntry(BLOB, 64)]}, "listed twice"),
        ({"blobs": [BlobEntry(BLOB, -1)]}, "invalid blob entry"),
        ({"schema_version": 1}, "schema_version 1"),
    ],
)
def test_hostile_blob_entries_are_corrupt(changes: dict[str, object], match: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=match):
        decode_manifest(encode_manifest(_manifest(**changes)))


def test_blob_names_stay_in_the_blob_folder() -> None:
    assert is_blob_name(BLOB)
    for bad in ("xxh128-" + "0" * 31, "xxh128-" + "g" * 32, "../" + BLOB, BLOB + "/x", ""):
        assert not is_blob_name(bad)
    assert blob_path(BLOB) == f"blobs/{BLOB}"


def test_pins_protect_blobs_until_removed(tmp_path: Path) -> None:
    store = LocalStore(str(tmp_path))
    assert read_pins(store) == set()
    pin = write_pin(store, 7, "abcd0123", [BLOB])
    assert read_pins(store) == {BLOB}
    (tmp_path / "blobs").mkdir()
    (tmp_path / blob_path(BLOB)).write_bytes(b"x" * 64)
    # Its checkpoint was deleted, but a save in flight pinned the blob.
    assert drop_blobs(store, [_manifest()]) == []
    remove_pin(store, pin)
    assert drop_blobs(store, [_manifest()]) == [BLOB]
    assert not (tmp_path / blob_path(BLOB)).exists()


def test_an_unreadable_pin_stops_every_blob_deletion(tmp_path: Path) -> None:
    store = LocalStore(str(tmp_path))
    (tmp_path / "pins").mkdir()
    (tmp_path / "pins" / "000000000007.abcd0123.json").write_bytes(b"{not json")
    (tmp_path / "blobs").mkdir()
    (tmp_path / blob_path(BLOB)).write_bytes(b"x" * 64)
    assert read_pins(store) is None
    assert drop_blobs(store, [_manifest()]) == []
    assert (tmp_path / blob_path(BLOB)).exists()


def test_gc_keeps_an_orphan_blob_written_again_since_its_scan(tmp_path: Path) -> None:
    store = LocalStore(str(tmp_path))
    (tmp_path / "blobs").mkdir()
    path = tmp_path / blob_path(BLOB)
    path.write_bytes(b"x" * 64)
    old = time.time() - 7200
    os.utime(path, (old, old))
    found = [x for x in scan_leftovers(store, older_than=3600).leftovers if x.kind == "blob"]
    assert [x.path for x in found] == [blob_path(BLOB)]
    path.write_bytes(b"x" * 64)  # a save wrote the same bytes again since the scan
    remove_leftovers(store, found)
    assert path.exists()
    os.utime(path, (old, old))
    remove_leftovers(store, found)
    assert not path.exists()


def _tampered(root: Path, **component_changes: object) -> None:
    """Rewrite step 1's manifest (with a valid digest) with the model's entry changed."""
    store = LocalStore(str(root))
    manifest = read_manifest(store, 1)
    entry = msgspec.structs.replace(manifest.components["model"], **component_changes)
    changed = msgspec.structs.replace(manifest, components={"model": entry})
    (root / "000000000001" / "manifest.json").write_bytes(encode_manifest(changed))


@pytest.mark.parametrize("damage", ["shape", "dtype", "twice"])
def test_a_ref_that_contradicts_its_blob_is_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    monkeypatch.setattr(tunables, "INCREMENTAL_MIN_BYTES", 1024)
    state = {"model": {"w": torch.ones(32, 32), "tiny": torch.ones(2)}}
    with checkpointd.CheckpointWriter(str(tmp_path), incremental=True) as writer:
        writer.save(1, state).result()
    manifest = read_manifest(LocalStore(str(tmp_path)), 1)
    ref = manifest.components["model"].refs["w"]
    if damage == "shape":
        refs = {"w": msgspec.structs.replace(ref, shape=[32, 16])}
    elif damage == "dtype":
        refs = {"w": msgspec.structs.replace(ref, dtype="NOPE")}
    else:
        refs = {"w": ref, "tiny": ref}  # "tiny" is in the tensor file too
    _tampered(tmp_path, refs=refs)
    with pytest.raises(CorruptCheckpointError):
        checkpointd.load(str(tmp_path), 1)
