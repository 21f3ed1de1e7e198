"""``checkpointd verify`` refuses the shard indexes (schema 4) that ``load`` refuses, through
the same checks (read/indexes.py ``ShardIndexes``): a real 2-rank FSDP2 checkpoint with
index files, one index rewritten in a hostile way and its ``files`` entry (size, CRC32C)
fixed to match, so that only the index checks can tell."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

import checkpointd
from checkpointd import tunables
from checkpointd.errors import CorruptCheckpointError
from checkpointd.format.checksum import crc32c
from checkpointd.format.layout import MANIFEST_NAME, step_dirname
from checkpointd.format.manifest import decode_manifest, encode_manifest
from checkpointd.read import catalog
from checkpointd.read.verify import verify_step
from checkpointd.storage import open_store
from tests.integration.test_sharded import job
from tests.support.service import run_python

Index = dict[str, Any]


@pytest.fixture(scope="module")
def indexed(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An FSDP2 job of 2 ranks saved with shard indexes (step 1)."""
    base = tmp_path_factory.mktemp("indexed")
    root = str(base / "root")
    job("save", "fsdp2", root, base / "save", 2, CHECKPOINTD_TEST_SHARD_INDEX="1")
    return root


def _first(index: Index) -> dict[str, Any]:
    """The first shard of the model's first tensor in ``index``."""
    tensors = index["components"]["model"]
    shards: list[dict[str, Any]] = tensors[sorted(tensors)[0]]
    return shards[0]


def _other_file(index: Index, rank0: Index) -> None:
    _first(index)["file"] = _first(rank0)["file"]


def _other_box(index: Index, rank0: Index) -> None:
    _first(index)["offsets"] = _first(rank0)["offsets"]


def _overlapping(index: Index, rank0: Index) -> None:
    _first(index)["offsets"][0] -= 1


def _outside(index: Index, rank0: Index) -> None:
    _first(index)["offsets"][0] += 1


def _wrong_step(index: Index, rank0: Index) -> None:
    index["step"] = 2


def _wrong_rank(index: Index, rank0: Index) -> None:
    index["rank"] = 0


HOSTILE: dict[str, tuple[Callable[[Index, Index], None], str]] = {
    "another rank's file": (_other_file, "has a shard in another rank's file"),
    "another rank's box": (_other_box, "overlap"),
    "overlapping": (_overlapping, "overlap"),
    "outside its tensor": (_outside, "lies outside"),
    "the wrong step": (_wrong_step, "not of step 1 rank 1"),
    "another rank's index": (_wrong_rank, "not of step 1 rank 1"),
    "a huge block list": (lambda index, rank0: None, "too large for a shard index"),
}


def _rewrite(root: Path, kind: str) -> str:
    """Rewrite rank 1's index of step 1 as ``kind`` says and fix its manifest entry to
    match the new bytes; the index's name."""
    folder = root / step_dirname(1)
    manifest = decode_manifest((folder / MANIFEST_NAME).read_bytes())
    names = manifest.shard_indexes
    rank0, index = (json.loads((folder / name).read_text()) for name in names)
    HOSTILE[kind][0](index, rank0)
    data = json.dumps(index).encode()
    if kind == "a huge block list":  # digests past what any reader decodes
        count = tunables.MAX_MANIFEST_BYTES // len("4294967295,") + 1
        data = data.replace(b'"crc32c": [', b'"crc32c": [' + b"4294967295," * count, 1)
        assert len(data) > tunables.MAX_MANIFEST_BYTES
    path = folder / names[1]
    path.chmod(0o644)
    path.write_bytes(data)
    files = [
        msgspec.structs.replace(f, size=len(data), crc32c=crc32c(data)) if f.path == names[1] else f
        for f in manifest.files
    ]
    (folder / MANIFEST_NAME).chmod(0o644)
    (folder / MANIFEST_NAME).write_bytes(
        encode_manifest(msgspec.structs.replace(manifest, files=files))
    )
    return names[1]


def test_the_intact_indexed_checkpoint_verifies(indexed: str) -> None:
    done = run_python("-m", "checkpointd", "verify", indexed, check=False)
    assert done.returncode == 0, done.stderr
    assert checkpointd.load(indexed, 1).state["model"]


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_verify_refuses_each_hostile_index_that_load_refuses(
    indexed: str, tmp_path: Path, kind: str
) -> None:
    root = tmp_path / "root"
    shutil.copytree(indexed, root)
    name = _rewrite(root, kind)
    expected = HOSTILE[kind][1]
    with pytest.raises(CorruptCheckpointError, match=expected) as refused:
        checkpointd.load(str(root), 1)
    done = run_python("-m", "checkpointd", "verify", str(root), check=False)
    assert done.returncode != 0, done.stdout
    (line,) = done.stderr.strip().splitlines()  # one clear line, no traceback
    assert line.startswith("checkpointd verify: 1 failure(s); first: ")
    assert expected in line
    # the same check made both refusals: load's message is verify's line
    assert str(refused.value) in line
    if expected != "overlap":  # a tiling problem is the tensor's; the others the index's
        assert name in line
    store = open_store(str(root))
    bad = verify_step(store, 1, catalog.read_manifest(store, 1))
    assert bad == [str(refused.value)]
