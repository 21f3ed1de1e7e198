"""A manifest with a valid digest but absurdly deep JSON costs only its own step.

Listing, loading the newest good step, ``checkpointd ls`` and the writer's
retention skip it with a CheckpointWarning; loading that step by number is a
CorruptCheckpointError. Never a raw RecursionError.
"""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest
import torch

import checkpointd
from checkpointd import tunables
from checkpointd.errors import CorruptCheckpointError, UnsupportedValueError
from checkpointd.format.checksum import crc32c
from checkpointd.format.manifest import (
    Manifest,
    decode_manifest,
    encode_manifest,
    step_dirname,
)
from checkpointd.read.catalog import CheckpointWarning

HOSTILE = 3


def _now() -> datetime:
    return datetime.now(UTC)


def _nested(depth: int) -> bytes:
    return b'{"a":' * (depth - 1) + b"[]" + b"}" * (depth - 1)


def _hostile_bytes(manifest: Manifest, field: str, depth: int) -> bytes:
    """``manifest`` with ``field`` nested ``depth`` deep, under a valid trailing CRC32C.

    Built by splicing bytes: encode_manifest (rightly) refuses to write it."""
    body = msgspec.json.encode(msgspec.structs.replace(manifest, **{field: {"x": "PLACEHOLDER"}}))
    body = body.replace(b'"PLACEHOLDER"', _nested(depth))
    return body[:-1] + b',"manifest_crc32c":"%08x"}\n' % crc32c(body)


def _root(tmp_path: Path, field: str = "metadata", depth: int = 5000) -> str:
    """Steps 1 and 2 good, step 3 (the newest) with a hostile manifest."""
    root = str(tmp_path / "ckpt")
    with checkpointd.CheckpointWriter(root) as writer:
        for step in (1, 2, HOSTILE):
            writer.save(step, {"m": {"w": torch.full((4,), float(step))}}).result(timeout=60)
    path = Path(root) / step_dirname(HOSTILE) / "manifest.json"
    manifest = decode_manifest(path.read_bytes())
    path.write_bytes(_hostile_bytes(manifest, field, depth))
    return root


@pytest.mark.parametrize(
    ("field", "depth"),
    [("metadata", 5000), ("metrics", 5000), ("metadata", tunables.MAX_JSON_DEPTH + 1)],
)
def test_decode_refuses_deep_json_as_corrupt(field: str, depth: int) -> None:
    manifest = Manifest(1, HOSTILE, _now(), "x", {}, [])
    with pytest.raises(CorruptCheckpointError, match="nested"):
        decode_manifest(_hostile_bytes(manifest, field, depth))


def test_decode_accepts_json_at_the_depth_limit() -> None:
    manifest = Manifest(1, HOSTILE, _now(), "x", {}, [])
    # The field's own dict is one level, the placeholder's value the rest.
    decoded = decode_manifest(_hostile_bytes(manifest, "metadata", tunables.MAX_JSON_DEPTH - 1))
    assert "x" in decoded.metadata


def test_encode_refuses_metadata_it_could_not_read_back() -> None:
    deep: dict[str, object] = {}
    for _ in range(tunables.MAX_JSON_DEPTH + 1):
        deep = {"a": deep}
    with pytest.raises(UnsupportedValueError, match="nested"):
        encode_manifest(Manifest(1, 1, _now(), "x", {}, [], metadata=deep))


def test_list_and_load_skip_the_hostile_step(tmp_path: Path) -> None:
    root = _root(tmp_path)
    with pytest.warns(CheckpointWarning, match=f"skipping step {HOSTILE}"):
        assert [info.step for info in checkpointd.list_checkpoints(root)] == [1, 2]
    with pytest.warns(CheckpointWarning, match=f"skipping step {HOSTILE}"):
        loaded = checkpointd.load(root)
    assert loaded.info.step == 2
    assert torch.equal(loaded.state["m"]["w"], torch.full((4,), 2.0))
    with pytest.raises(CorruptCheckpointError, match="nested"):
        checkpointd.load(root, HOSTILE)


def test_restore_takes_the_newest_good_step(tmp_path: Path) -> None:
    root = _root(tmp_path, "metrics")
    target = {"w": torch.zeros(4)}
    with pytest.warns(CheckpointWarning, match=f"skipping step {HOSTILE}"):
        info = checkpointd.restore(root, {"m": target})
    assert info.step == 2
    assert torch.equal(target["w"], torch.full((4,), 2.0))


def test_cli_ls_warns_and_lists_the_rest(tmp_path: Path) -> None:
    root = _root(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "checkpointd", "ls", root],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert f"skipping step {HOSTILE}" in done.stderr
    steps = [line.split()[0] for line in done.stdout.splitlines()[1:]]
    assert steps == ["1", "2"]


def _save_twice_keeping_one(root: str) -> None:
    """Two saves: a retention failure of the first would be raised by the second or close."""
    with checkpointd.CheckpointWriter(root, keep_last=1) as writer:
        writer.save(4, {"m": {"w": torch.ones(4)}}).result(timeout=60)
        writer.save(5, {"m": {"w": torch.ones(4)}}).result(timeout=60)
        writer.wait(timeout=60)


def test_writer_retention_skips_the_hostile_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _root(tmp_path)
    # Steps 1 and 2 come from another writer: without this, the grace window keeps them.
    monkeypatch.setattr(checkpointd.tunables, "GRACE_SECONDS", 0.0)
    with pytest.warns(CheckpointWarning, match=f"skipping step {HOSTILE}"):
        _save_twice_keeping_one(root)
    with pytest.warns(CheckpointWarning):
        assert [info.step for info in checkpointd.list_checkpoints(root)] == [5]
    # Not a checkpoint, so retention never counts or deletes it; it stays for a human to see.
    assert (Path(root) / step_dirname(HOSTILE) / "manifest.json").exists()
