"""plan.py decides what a save writes; commit.py makes any plan durable without knowing
about components (the seam for many ranks and incremental references)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import anyio
import numpy as np
import pytest
import torch

from checkpointd import tunables
from checkpointd.errors import CheckpointError, CheckpointExistsError
from checkpointd.format import layout
from checkpointd.format.header import header_length
from checkpointd.format.manifest import BlobEntry, CheckpointInfo
from checkpointd.maintain.retention import WriterIdentity
from checkpointd.read.catalog import read_manifest
from checkpointd.read.restore import load
from checkpointd.storage import LocalStore
from checkpointd.write.capture import StagingBuffer, capture
from checkpointd.write.commit import info_of, publish_plan
from checkpointd.write.handle import first_leaf
from checkpointd.write.items import (
    KeepBlob,
    PlannedFile,
    RankFile,
    WriteBlob,
    WriteFile,
    assign_ranks,
)
from checkpointd.write.plan import SavePlan, Snapshot, plan_snapshot


def _snapshot(step: int = 1) -> Snapshot:
    state = {
        "big": {"w": torch.ones(tunables.DIRECT_MIN_BYTES // 4, dtype=torch.float32)},
        "small": {"b": torch.arange(3), "lr": 0.1},
        "meta": {"epoch": 2},
    }
    buffer = StagingBuffer()
    return Snapshot(step, capture(state, buffer), buffer, datetime.now(UTC), {"loss": 1.0}, {})


def test_plan_lists_a_tree_file_per_component_and_a_tensor_file_when_it_has_tensors() -> None:
    plan = plan_snapshot(_snapshot(), token="0123abcd")
    names = [f.name for f in plan.files]
    assert names == [
        "big.0123abcd.tree.msgpack",
        "big.0123abcd.safetensors",
        "small.0123abcd.tree.msgpack",
        "small.0123abcd.safetensors",
        "meta.0123abcd.tree.msgpack",
    ]
    assert all(f.rank == 0 for f in plan.files)
    assert [f.component for f in plan.files] == ["big", "big", "small", "small", "meta"]
    assert plan.components["meta"].tensors == []
    assert plan.components["big"].tensors == ["big.0123abcd.safetensors"]
    assert plan.components["small"].num_tensors == 1  # "lr" is a float in the tree


def test_large_data_regions_start_direct_io_aligned() -> None:
    plan = plan_snapshot(_snapshot(), token="0123abcd")
    by_name = {f.name: f for f in plan.files}
    for name, align in (("big", layout.DIRECT_ALIGN), ("small", layout.HEADER_ALIGN)):
        header = bytes(by_name[f"{name}.0123abcd.safetensors"].parts[0])
        start = 8 + header_length(header, len(header), where=name)
        assert start % align == 0
        assert len(header) == start  # the header part ends where the data begins
    assert start < layout.DIRECT_ALIGN  # the small one is not padded to 4 KiB
    assert plan.files[0].size == len(bytes(plan.files[0].parts[0]))


def test_commit_writes_any_plan_it_is_given(tmp_path: Path) -> None:
    """No component, tree or safetensors knowledge in commit: plain files commit too."""
    store = LocalStore(str(tmp_path))
    parts = [b"hello ", np.arange(4, dtype=np.uint8).tobytes()]
    plan = SavePlan(7, [WriteFile("notes.bin", parts, "")], {}, datetime.now(UTC), {}, {})
    identity = WriterIdentity()

    async def commit() -> CheckpointInfo:
        limiter = anyio.CapacityLimiter(2)
        manifest = await publish_plan(store, plan, limiter, identity=identity, chunk_bytes=2**20)
        return info_of(store, manifest)

    info = anyio.run(commit)

    assert info.step == 7
    assert (tmp_path / "000000000007" / "notes.bin").read_bytes() == b"hello \x00\x01\x02\x03"
    manifest = read_manifest(store, 7)
    assert [(f.path, f.size, f.rank) for f in manifest.files] == [("notes.bin", 10, 0)]
    assert manifest.writer == identity.id
    with pytest.raises(CheckpointExistsError):
        anyio.run(commit)


def test_a_planned_snapshot_commits_and_loads(tmp_path: Path) -> None:
    store = LocalStore(str(tmp_path))
    plan = plan_snapshot(_snapshot(3))

    async def commit() -> None:
        await publish_plan(store, plan, anyio.CapacityLimiter(4), chunk_bytes=2**20)

    anyio.run(commit)
    checkpoint = load(str(tmp_path))
    assert checkpoint.info.step == 3
    assert checkpoint.info.metrics == {"loss": 1.0}
    assert torch.equal(checkpoint.state["small"]["b"], torch.arange(3))
    assert checkpoint.state["meta"] == {"epoch": 2}


def _blob(data: bytes) -> str:
    from checkpointd.format.digest import blob_name

    return blob_name(data)


def test_every_item_of_a_plan_names_the_rank_that_makes_it_durable() -> None:
    """Replicated files are spread by size, a rank's own files stay with it, and every
    rank that plans the same replicated items assigns them alike."""
    files: list[PlannedFile] = [
        WriteFile("a", [b"x" * 30], "m"),
        WriteFile("b", [b"x" * 20], "m"),
        RankFile("shards", [b"x" * 100], "m", rank=1),
        WriteBlob(_blob(b"y" * 25), [b"y" * 25]),
        WriteBlob(_blob(b"z" * 5), [b"z" * 5], rank=1, own=True),
        KeepBlob(BlobEntry(_blob(b"k"), 1), None),
        KeepBlob(BlobEntry(_blob(b"j"), 1), None),
    ]
    ranked = assign_ranks(files, 2)
    assert [f.kind for f in ranked] == [f.kind for f in files]
    assert [f.rank for f in ranked[:5]] == [0, 1, 1, 1, 1]  # 30 -> 0, 25 -> 1, 20 -> 1
    assert sorted(f.rank for f in ranked[5:]) == [0, 1]  # kept blobs: checked round-robin
    assert [f.rank for f in assign_ranks(files, 1)] == [0, 0, 1, 0, 1, 0, 0]  # own: kept


def test_a_per_rank_component_and_shards_plan_rank_files() -> None:
    snapshot = _snapshot()
    snapshot.per_rank = {"small": "rng"}
    snapshot.rank = 1
    plan = plan_snapshot(snapshot, token="0123abcd", world_size=2)
    kinds = {f.name: (f.kind, f.rank) for f in plan.files}
    assert kinds["small.0123abcd.tree.msgpack"] == ("rank-file", 1)
    assert kinds["small.0123abcd.safetensors"] == ("rank-file", 1)
    assert {kinds[f"{n}.0123abcd.tree.msgpack"][0] for n in ("big", "meta")} == {"file"}


def test_commit_writes_new_blobs_and_checks_kept_ones(tmp_path: Path) -> None:
    """The commit is the one place blobs are written: a new one is written, a kept one
    that vanished is written again from the snapshot's copy, and a kept one with no copy
    fails the save before anything is published."""
    store = LocalStore(str(tmp_path))
    new, kept = b"new bytes" * 10, b"kept bytes" * 10
    kept_entry = BlobEntry(_blob(kept), len(kept), written=False)

    def plan(step: int, copy: bytes | None) -> SavePlan:
        files: list[PlannedFile] = [
            WriteFile("notes.bin", [b"hi"], ""),
            WriteBlob(_blob(new), [new]),
            KeepBlob(kept_entry, None if copy is None else [copy]),
        ]
        return SavePlan(step, files, {}, datetime.now(UTC), {}, {})

    def commit(step: int, copy: bytes | None) -> CheckpointInfo:
        async def run() -> CheckpointInfo:
            manifest = await publish_plan(
                store, plan(step, copy), anyio.CapacityLimiter(2), chunk_bytes=2**20
            )
            return info_of(store, manifest)

        return anyio.run(run)

    with pytest.raises(ExceptionGroup) as raised:
        commit(1, None)  # the kept blob is not stored, and there is no copy of it
    error = first_leaf(raised.value)  # as the writer reports it
    assert isinstance(error, CheckpointError)
    assert "holds no copy" in str(error)
    assert not (tmp_path / "000000000001" / "notes.bin").exists()
    info = commit(2, kept)
    assert (tmp_path / "blobs" / _blob(new)).read_bytes() == new
    assert (tmp_path / "blobs" / _blob(kept)).read_bytes() == kept  # repaired
    manifest = read_manifest(store, 2)
    assert {(b.name, b.written) for b in manifest.blobs} == {
        (_blob(new), True),
        (_blob(kept), True),
    }
    assert info.referenced_nbytes == 0
    commit(3, None)  # now stored: referenced, nothing written
    assert read_manifest(store, 3).referenced_nbytes == len(kept)
