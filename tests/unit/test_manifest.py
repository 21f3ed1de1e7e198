"""The manifest: its digest trailer, schema versions and safety checks."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
import pytest

from checkpointd.errors import CorruptCheckpointError, IncompatibleCheckpointError
from checkpointd.format.checksum import crc32c
from checkpointd.format.manifest import (
    SCHEMA_VERSION,
    ComponentEntry,
    FileEntry,
    Manifest,
    decode_manifest,
    encode_manifest,
)


def _manifest(**changes: object) -> Manifest:
    base = Manifest(
        schema_version=SCHEMA_VERSION,
        step=12,
        created_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
        library_version="0.1.0",
        components={"model": ComponentEntry("model.tree.msgpack", ["model.safetensors"], 8, 1)},
        files=[
            FileEntry("model.safetensors", 100, 0xDEADBEEF),
            FileEntry("model.tree.msgpack", 10, 7),
        ],
        metrics={"loss": 0.5},
        metadata={"note": "x"},
    )
    return msgspec.structs.replace(base, **changes)


def _reencode(raw: dict[str, object]) -> bytes:
    """Encode a raw manifest dict with a valid trailer (to test checks after the digest)."""
    body = msgspec.json.encode(raw)
    return body[:-1] + b',"manifest_crc32c":"%08x"}\n' % crc32c(body)


def test_round_trip() -> None:
    manifest = _manifest()
    data = encode_manifest(manifest)
    assert data.endswith(b'"}\n')
    assert decode_manifest(data) == manifest
    assert manifest.nbytes == 110


def test_a_flipped_bit_anywhere_is_detected() -> None:
    data = bytearray(encode_manifest(_manifest()))
    for position in range(0, len(data) - 1, 7):
        damaged = bytearray(data)
        damaged[position] ^= 0x04
        with pytest.raises(CorruptCheckpointError):
            decode_manifest(bytes(damaged))


def test_newer_schema_is_refused_with_upgrade_hint() -> None:
    raw = msgspec.to_builtins(_manifest())
    raw["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(IncompatibleCheckpointError, match="upgrade"):
        decode_manifest(_reencode(raw))


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    raw = msgspec.to_builtins(_manifest())
    raw["added_later"] = {"x": 1}
    assert decode_manifest(_reencode(raw)) == _manifest()


@pytest.mark.parametrize("bad", ["../x", "/etc/passwd", "a/b", ".hidden", "manifest.json", ""])
def test_unsafe_file_names_are_refused(bad: str) -> None:
    raw = msgspec.to_builtins(_manifest())
    raw["files"][0]["path"] = bad
    raw["components"]["model"]["tensors"] = [bad]
    with pytest.raises(CorruptCheckpointError, match="unsafe"):
        decode_manifest(_reencode(raw))


def test_component_naming_an_unlisted_file_is_refused() -> None:
    raw = msgspec.to_builtins(_manifest())
    raw["components"]["model"]["tree"] = "other.tree.msgpack"
    with pytest.raises(CorruptCheckpointError, match="unlisted"):
        decode_manifest(_reencode(raw))


def test_not_json_is_corrupt() -> None:
    body = b"\x80\x81 not json"
    data = body[:-1] + b',"manifest_crc32c":"%08x"}\n' % crc32c(body[:-1] + b"}")
    with pytest.raises(CorruptCheckpointError):
        decode_manifest(data)
    with pytest.raises(CorruptCheckpointError, match="trailer"):
        decode_manifest(b"{}")


def test_a_manifest_no_reader_would_accept_is_refused_when_encoded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from checkpointd import tunables
    from checkpointd.errors import UnsupportedValueError

    base = _manifest()
    manifest = _manifest(files=[*base.files, *(FileEntry(f"f{i}.bin", i, i) for i in range(200))])
    fits = encode_manifest(manifest)
    monkeypatch.setattr(tunables, "MAX_MANIFEST_BYTES", len(fits))
    assert decode_manifest(encode_manifest(manifest)) == manifest
    monkeypatch.setattr(tunables, "MAX_MANIFEST_BYTES", len(fits) - 100)
    with pytest.raises(UnsupportedValueError, match="MAX_MANIFEST_BYTES"):
        encode_manifest(manifest)
