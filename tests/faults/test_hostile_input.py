"""Damaged and hostile checkpoints: every one is refused with a typed error.

Nothing is parsed before its size and digest check out, nothing outside the
root is opened, and nothing is unpickled (a sentinel a pickle would create
never appears). Plus hypothesis fuzzing of the manifest and header parsers.
"""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import checkpointd
from checkpointd.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    StorageError,
)
from checkpointd.format.checksum import crc32c
from checkpointd.format.header import header_length, parse_safetensors_header
from checkpointd.format.manifest import FileEntry, Manifest, decode_manifest, encode_manifest
from tests.support.files import component_file

FOLDER = "000000000001"


def _tensors(root: str) -> str:
    """The model's tensor file (its name carries the save's token)."""
    return component_file(root, 1, "model")


def _save(root: str) -> None:
    with checkpointd.CheckpointWriter(root) as writer:
        state = {"model": {"w": torch.arange(64.0), "b": torch.ones(8, dtype=torch.int64)}}
        writer.save(1, state).result()


def _manifest(root: str) -> Manifest:
    with open(f"{root}/{FOLDER}/manifest.json", "rb") as f:
        return decode_manifest(f.read())


def _write_manifest(root: str, manifest: Manifest, raw: bytes | None = None) -> None:
    with open(f"{root}/{FOLDER}/manifest.json", "wb") as f:
        f.write(encode_manifest(manifest) if raw is None else raw)


def _replace_file(root: str, name: str, data: bytes) -> None:
    """Put ``data`` in a file and make the manifest vouch for it (size and CRC32C match)."""
    with open(f"{root}/{FOLDER}/{name}", "wb") as f:
        f.write(data)
    manifest = _manifest(root)
    files = [
        FileEntry(e.path, len(data), crc32c(data)) if e.path == name else e for e in manifest.files
    ]
    _write_manifest(root, msgspec.structs.replace(manifest, files=files))


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def _truncate(root: str) -> None:
    os.truncate(f"{root}/{FOLDER}/{_tensors(root)}", 100)


def _flip_data(root: str) -> None:
    path = f"{root}/{FOLDER}/{_tensors(root)}"
    _flip(path, os.path.getsize(path) - 3)


def _flip_header(root: str) -> None:
    _flip(f"{root}/{FOLDER}/{_tensors(root)}", 20)


def _flip_manifest(root: str) -> None:
    _flip(f"{root}/{FOLDER}/manifest.json", 40)


def _terabyte_header(root: str) -> None:
    _replace_file(root, _tensors(root), (2**40).to_bytes(8, "little") + b"{}" + b" " * 30)


def _path_entry(path: str) -> Callable[[str], None]:
    def damage(root: str) -> None:
        manifest = _manifest(root)
        tensors = _tensors(root)
        files = [
            FileEntry(path, e.size, e.crc32c) if e.path == tensors else e for e in manifest.files
        ]
        components = {
            name: msgspec.structs.replace(c, tensors=[path])
            for name, c in manifest.components.items()
        }
        _write_manifest(root, msgspec.structs.replace(manifest, files=files, components=components))

    return damage


def _symlink_outside(root: str) -> None:
    target = f"{root}/{FOLDER}/{_tensors(root)}"
    outside = os.path.join(os.path.dirname(root), "outside.safetensors")
    os.replace(target, outside)  # same bytes: size and digest would match if it were followed
    os.symlink(outside, target)


def _fifo(root: str) -> None:
    target = f"{root}/{FOLDER}/{component_file(root, 1, 'model', 'tree')}"
    os.unlink(target)
    os.mkfifo(target)


def _newer_schema(root: str) -> None:
    _write_manifest(root, msgspec.structs.replace(_manifest(root), schema_version=99))


class _Sentinel:
    path = ""

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def _pickle_payload(root: str) -> None:
    _Sentinel.path = os.path.join(os.path.dirname(root), "SENTINEL")
    _replace_file(root, _tensors(root), pickle.dumps({"w": _Sentinel()}))


DAMAGE: dict[str, tuple[Callable[[str], None], type[CheckpointError]]] = {
    "truncated-file": (_truncate, CorruptCheckpointError),
    "flipped-tensor-data": (_flip_data, CorruptCheckpointError),
    "flipped-header": (_flip_header, CorruptCheckpointError),
    "flipped-manifest": (_flip_manifest, CorruptCheckpointError),
    "terabyte-header-length": (_terabyte_header, CorruptCheckpointError),
    "dotdot-path": (_path_entry("../x"), CorruptCheckpointError),
    "absolute-path": (_path_entry("/etc/passwd"), CorruptCheckpointError),
    "symlink-outside-root": (_symlink_outside, StorageError),
    "fifo": (_fifo, StorageError),
    "newer-schema": (_newer_schema, IncompatibleCheckpointError),
    "pickle-renamed-safetensors": (_pickle_payload, CorruptCheckpointError),
}


@pytest.mark.timeout(30)  # a FIFO opened for reading without O_NONBLOCK would hang here
@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_checkpoint_refused(tmp_path: Path, case: str) -> None:
    root = str(tmp_path / "ckpt")
    _save(root)
    with open(tmp_path / "x", "wb") as f:  # what ../x would reach
        f.write(b"outside")
    damage, expected = DAMAGE[case]
    damage(root)
    with pytest.raises(expected):
        checkpointd.load(root, 1)
    with pytest.raises(expected):
        checkpointd.restore(root, {"model": torch.nn.Module()}, 1, strict=False)
    assert not (tmp_path / "SENTINEL").exists()


def test_pickle_sentinel_would_fire(tmp_path: Path) -> None:
    """The payload is live: unpickling it does create the sentinel (so the test above means it)."""
    root = str(tmp_path / "ckpt")
    _save(root)
    _pickle_payload(root)
    with open(f"{root}/{FOLDER}/{_tensors(root)}", "rb") as f:
        loaded = pickle.loads(f.read())  # deliberately, in this control test only
    loaded["w"].close()
    assert (tmp_path / "SENTINEL").exists()


# -- fuzzing -----------------------------------------------------------------

_FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _valid_manifest() -> bytes:
    import datetime

    manifest = Manifest(
        schema_version=1,
        step=7,
        created_at=datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC),
        library_version="0.1.0",
        components={"m": checkpointd.format.manifest.ComponentEntry(tree="m.tree.msgpack")},
        files=[FileEntry("m.tree.msgpack", 10, 123)],
    )
    return encode_manifest(manifest)


@_FUZZ
@given(st.binary(max_size=2048))
def test_fuzz_manifest_random_bytes(data: bytes) -> None:
    with contextlib.suppress(CheckpointError):
        decode_manifest(data)


@_FUZZ
@given(st.data())
def test_fuzz_manifest_mutations(data: st.DataObject) -> None:
    raw = bytearray(_valid_manifest())
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        at = data.draw(st.integers(0, len(raw) - 1))
        if kind == "flip":
            raw[at] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "cut":
            del raw[at:]
            if not raw:
                break
        else:
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    with contextlib.suppress(CheckpointError):
        decode_manifest(bytes(raw))


@_FUZZ
@given(
    st.dictionaries(
        st.text(max_size=10),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=8),
            lambda inner: (
                st.lists(inner, max_size=4)
                | st.dictionaries(st.text(max_size=8), inner, max_size=4)
            ),
            max_leaves=12,
        ),
        max_size=5,
    ),
    st.integers(-10, 2**40),
)
def test_fuzz_manifest_structured(fields: dict[str, Any], step: int) -> None:
    """Well-formed JSON with a valid digest but arbitrary fields: still only typed errors."""
    body = msgspec.json.encode({"schema_version": 1, "step": step, **fields})
    raw = body[:-1] + b',"manifest_crc32c":"%08x"}\n' % crc32c(body)
    with contextlib.suppress(CheckpointError):
        decode_manifest(raw)


_entry = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "F16", "I64", "BOOL", "U8", "X9", ""]),
        "shape": st.lists(st.integers(-2, 2**33), max_size=4),
        "data_offsets": st.lists(st.integers(-5, 2**41), min_size=0, max_size=3),
    }
)


@_FUZZ
@given(
    st.dictionaries(st.text(max_size=8), _entry | st.integers() | st.text(), max_size=4),
    st.integers(0, 4096),
)
def test_fuzz_header_structured(header: dict[str, Any], data_size: int) -> None:
    with contextlib.suppress(CheckpointError):
        parse_safetensors_header(msgspec.json.encode(header), data_size, where="fuzz")


@_FUZZ
@given(st.binary(max_size=512), st.integers(0, 2**50))
def test_fuzz_header_random_bytes(data: bytes, file_size: int) -> None:
    try:
        length = header_length(data[:8], file_size, where="fuzz")
        assert length <= file_size - 8
        parse_safetensors_header(data[8 : 8 + length], max(0, file_size - 8 - length), where="fuzz")
    except CheckpointError:
        pass
