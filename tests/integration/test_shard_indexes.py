"""Shard index files (schema 4) with real gloo ranks: jobs whose ranks x sharded tensors
pass tunables.SHARD_INDEX_MIN_ENTRIES (forced here with CHECKPOINTD_TEST_SHARD_INDEX=1)
keep their shard entries in one index file per rank, referenced from the manifest. The
checkpoint must restore bit for bit on another world size and layout, a restore on the
saving layout must read only its own rank's index, and verify, gc, describe and damage
must treat the index files as part of the step. Checkpoints of small jobs (the inline
path, every checkpoint written before schema 4) read as before."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import checkpointd
from checkpointd.errors import CorruptCheckpointError
from checkpointd.format.layout import step_dirname
from checkpointd.format.manifest import SCHEMA_VERSION
from checkpointd.maintain.gc import apply_gc, plan_gc
from checkpointd.maintain.retention import RetentionPolicy
from checkpointd.read import catalog
from checkpointd.read.describe import describe
from checkpointd.read.verify import verify_step
from checkpointd.storage import open_store
from tests.integration.test_sharded import check_restored, job, same

INDEXED = {"CHECKPOINTD_TEST_SHARD_INDEX": "1"}


@pytest.fixture(scope="module")
def indexed_on_2(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """An FSDP2 job of 2 ranks saved with shard indexes: (root, the job's output)."""
    base = tmp_path_factory.mktemp("indexed_on_2")
    root = str(base / "root")
    return root, job("save", "fsdp2", root, base / "save", 2, **INDEXED)


def test_the_manifest_references_one_index_per_rank_instead_of_listing_shards(
    indexed_on_2: tuple[str, Path],
) -> None:
    root, _ = indexed_on_2
    manifest = catalog.read_manifest(open_store(root), 1)
    assert manifest.schema_version == SCHEMA_VERSION == 4
    ranks = {f.path: f.rank for f in manifest.files}
    assert [ranks[name] for name in manifest.shard_indexes] == [0, 1]
    assert all(name.startswith("shards.") for name in manifest.shard_indexes)
    for component in ("model", "optimizer"):
        for tensor in manifest.components[component].sharded.values():
            assert tensor.shards == []  # dtype and global shape only; the shards are indexed
    index = json.loads((Path(root) / step_dirname(1) / manifest.shard_indexes[1]).read_text())
    assert index["rank"] == 1
    assert index["step"] == 1
    assert all(
        s["file"].endswith(".rank1.safetensors")
        for tensors in index["components"].values()
        for shards in tensors.values()
        for s in shards
    )


def test_an_indexed_checkpoint_restores_on_3_and_loads_whole(
    indexed_on_2: tuple[str, Path], tmp_path: Path
) -> None:
    root, saved = indexed_on_2
    out = job("restore", "fsdp2", root, tmp_path / "restore", 3)
    check_restored(saved, out)
    checkpoint = checkpointd.load(root)
    expected = torch.load(saved / "save.pt")
    same(expected["model"], checkpoint.state["model"])
    same(expected["optimizer"], checkpoint.state["optimizer"]["state"])


def test_a_restore_on_the_saving_layout_reads_only_its_own_index(
    indexed_on_2: tuple[str, Path], tmp_path: Path
) -> None:
    root, saved = indexed_on_2
    out = job("restore", "fsdp2", root, tmp_path / "restore", 2)
    check_restored(saved, out)
    manifest = catalog.read_manifest(open_store(root), 1)
    for rank in range(2):
        report = json.loads((out / f"rank{rank}.json").read_text())
        assert report["indexes_read"] == [manifest.shard_indexes[rank]], report


def test_verify_gc_and_describe_see_the_index_files_as_part_of_the_step(
    indexed_on_2: tuple[str, Path],
) -> None:
    root, _ = indexed_on_2
    store = open_store(root)
    manifest = catalog.read_manifest(store, 1)
    assert verify_step(store, 1, manifest) == []
    folder = Path(root) / step_dirname(1)
    (folder / "shards.00000000.rank7.json").write_text("{}")  # an unlisted leftover
    plan = plan_gc(store, RetentionPolicy(), older_than=0.0)
    apply_gc(store, plan)  # the leftover goes; the listed index files stay
    assert not (folder / "shards.00000000.rank7.json").exists()
    assert all((folder / name).exists() for name in manifest.shard_indexes)
    shown = describe(store, 1)["components"]["model"]["tensors"]
    shards = [t["shards"] for t in shown if "shards" in t]
    assert shards
    assert all(len(s) == 2 for s in shards)
    info = checkpointd.list_checkpoints(root)[0]
    assert info.nbytes == manifest.nbytes  # the index files count as the step's bytes


def test_a_damaged_or_missing_index_fails_load_and_verify(
    indexed_on_2: tuple[str, Path], tmp_path: Path
) -> None:
    root, _ = indexed_on_2
    copy = tmp_path / "root"
    shutil.copytree(root, copy)
    store = open_store(str(copy))
    manifest = catalog.read_manifest(store, 1)
    name = manifest.shard_indexes[0]
    path = copy / step_dirname(1) / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=name):
        checkpointd.load(str(copy))
    assert any(name in problem for problem in verify_step(store, 1, manifest))
    path.unlink()
    with pytest.raises(CorruptCheckpointError, match="missing"):
        checkpointd.load(str(copy))


def test_hsdp_on_4_with_indexes_restores_into_fsdp2_on_3(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    saved = job("save", "hsdp", root, tmp_path / "save", 4, **INDEXED)
    manifest = catalog.read_manifest(open_store(root), 1)
    assert manifest.schema_version == 4
    assert manifest.shard_indexes
    check_restored(saved, job("restore", "fsdp2", root, tmp_path / "restore", 3))


def test_small_jobs_keep_their_shards_inline_as_every_earlier_checkpoint(
    tmp_path: Path,
) -> None:
    root = str(tmp_path / "root")
    saved = job("save", "fsdp2", root, tmp_path / "save", 2)  # default threshold
    manifest = catalog.read_manifest(open_store(root), 1)
    assert manifest.schema_version == 2
    assert manifest.shard_indexes == []
    assert all(len(t.shards) == 2 for t in manifest.components["model"].sharded.values())
    out = job("restore", "fsdp2", root, tmp_path / "restore", 3)
    check_restored(saved, out)
    assert json.loads((out / "rank0.json").read_text())["indexes_read"] == []


def test_an_indexed_checkpoint_exports_like_any_other(
    indexed_on_2: tuple[str, Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    from checkpointd.interop.export import export_component

    root, saved = indexed_on_2
    target = str(tmp_path / "model.safetensors")
    export_component(root, "model", target)
    same(torch.load(saved / "save.pt")["model"], load_file(target))


def test_incremental_saves_with_indexes_reference_the_frozen_base(tmp_path: Path) -> None:
    """A LoRA-like FSDP2 job of 2 ranks, incremental, with shard indexes: the base's
    shards are blob shards in the indexes, referenced (not rewritten) by later saves."""
    from tests.integration.test_incremental_ranks import _same, _tensors
    from tests.integration.test_incremental_ranks import job as lora_job

    root, out = tmp_path / "root", tmp_path / "save"
    reports = lora_job("save", root, out, 2, **INDEXED)
    states = torch.load(out / "states.pt")
    base = sum(
        t.numel() * t.element_size()
        for name, t in _tensors(states[1]["model"]).items()
        if name.endswith("base.weight")
    )
    assert reports[0]["saves"]["3"]["referenced"] == base
    store = open_store(str(root))
    manifest = catalog.read_manifest(store, 3)
    assert manifest.schema_version == 4
    assert manifest.shard_indexes
    index = json.loads((root / step_dirname(3) / manifest.shard_indexes[0]).read_text())
    blobs = [s for ts in index["components"].values() for ss in ts.values() for s in ss]
    assert any(s.get("blob") for s in blobs)
    assert verify_step(store, 3, manifest) == []
    loaded = checkpointd.load(str(root), step=3).state
    _same(states[3]["model"], loaded["model"])
    restored = tmp_path / "restore"
    lora_job("restore", root, restored, 2, CHECKPOINTD_TEST_STEP="3")
    _same(states[3], torch.load(restored / "restored.pt"))
