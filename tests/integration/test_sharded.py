"""Sharded state (DTensor) on many ranks: FSDP2, HSDP, tensor parallel and DDP jobs of
2-4 real gloo ranks (tests/support/shard_job.py) save, then restore on another world
size and sharding. Each restore must give back the saved state bit for bit (both
gathered to whole tensors by torch.distributed.checkpoint.state_dict), and the restored
optimizer must train on: one more step lands where the saving job's next step did.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

import checkpointd
from checkpointd.errors import CorruptCheckpointError
from checkpointd.format.dtypes import decode_dtype, encode_dtype
from checkpointd.format.manifest import decode_manifest, encode_manifest, step_dirname
from checkpointd.read import catalog
from checkpointd.read.verify import verify_step
from checkpointd.storage import open_store
from tests.support.launch import REPO, run_ranks
from tests.support.s3 import MotoS3

BLOCK = 256  # shard block size at save: small, so partial reads show on a small model


def job(action: str, mode: str, root: str, out: Path, world: int, **env: str) -> Path:
    """Run the ranks of one shard_job and check every rank finished; returns ``out``."""
    reports = run_ranks(
        "tests.support.shard_job",
        [action, mode, root, str(out)],
        out,
        world,
        env={"CHECKPOINTD_TEST_BLOCK": str(BLOCK), **env},
    )
    for rank, report in enumerate(reports):
        assert report is not None, (out / f"stderr{rank}.txt").read_text()[-3000:]
        assert report["ok"], report
    return out


def same(saved: Any, restored: Any, *, exact: bool = True, path: str = "") -> None:
    """Assert two state trees are equal: bit for bit, or (``exact=False``) within float noise
    (a step on another world size reduces gradients in another order)."""
    if isinstance(saved, dict):
        assert saved.keys() == restored.keys(), path
        for key in saved:
            same(saved[key], restored[key], exact=exact, path=f"{path}/{key}")
    elif isinstance(saved, torch.Tensor):
        assert saved.dtype == restored.dtype, path
        assert saved.shape == restored.shape, path
        if exact:
            assert torch.equal(saved, restored), path
        else:
            assert torch.allclose(saved, restored, rtol=1e-4, atol=1e-6), path
    else:
        assert saved == restored, path


def check_restored(saved: Path, restored: Path) -> None:
    same(torch.load(saved / "save.pt"), torch.load(restored / "restore.pt"))
    same(torch.load(saved / "save_next.pt"), torch.load(restored / "restore_next.pt"), exact=False)


@pytest.fixture(scope="module")
def fsdp2_on_2(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A checkpoint saved by an FSDP2 job of 2 ranks: (root, the job's output folder)."""
    base = tmp_path_factory.mktemp("fsdp2_on_2")
    root = str(base / "root")
    return root, job("save", "fsdp2", root, base / "save", 2)


def test_fsdp2_on_2_restores_on_3_reading_only_the_overlapping_blocks(
    fsdp2_on_2: tuple[str, Path], tmp_path: Path
) -> None:
    root, saved = fsdp2_on_2
    out = job("restore", "fsdp2", root, tmp_path / "restore", 3)
    check_restored(saved, out)
    manifest = catalog.read_manifest(open_store(root), 1)
    assert manifest.schema_version == 2
    assert manifest.world_size == 2
    shard_files = [f for f in manifest.files if ".rank" in f.path]
    assert sorted({f.rank for f in shard_files}) == [0, 1]
    stored = sum(f.size for f in shard_files)
    for rank in range(3):
        report = json.loads((out / f"rank{rank}.json").read_text())
        # A third of the shards plus whole blocks at the edges, never all of them.
        assert 0 < report["shard_bytes_read"] < 0.6 * stored, report


def test_fsdp2_on_2_loads_whole_in_one_plain_process(fsdp2_on_2: tuple[str, Path]) -> None:
    root, saved = fsdp2_on_2
    checkpoint = checkpointd.load(root)
    expected = torch.load(saved / "save.pt")
    same(expected["model"], checkpoint.state["model"])
    same(expected["optimizer"], checkpoint.state["optimizer"]["state"])
    assert checkpoint.state["progress"] == {"epoch": 3}


def test_fsdp2_on_2_restores_into_a_plain_process(
    fsdp2_on_2: tuple[str, Path], tmp_path: Path
) -> None:
    root, saved = fsdp2_on_2
    check_restored(saved, job("restore", "plain", root, tmp_path / "restore", 1))


def test_a_damaged_shard_block_fails_load_and_verify(
    fsdp2_on_2: tuple[str, Path], tmp_path: Path
) -> None:
    root = tmp_path / "root"
    shutil.copytree(fsdp2_on_2[0], root)
    manifest = catalog.read_manifest(open_store(str(root)), 1)
    shard = manifest.components["model"].sharded["0.weight"].shards[1]
    path = root / "000000000001" / shard.file
    data = bytearray(path.read_bytes())
    data[shard.begin + 300] ^= 0x01  # in block 1 of the shard
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="block 1 of the shard at"):
        checkpointd.load(str(root), step=1)
    bad = verify_step(open_store(str(root)), 1, manifest)
    assert len(bad) == 1
    assert shard.file in bad[0]
    assert "CRC32C" in bad[0]


def test_sharded_tensors_read_either_dtype_spelling(
    fsdp2_on_2: tuple[str, Path], tmp_path: Path
) -> None:
    """Shards name their dtype as torch does ("float32"); with the safetensors code
    ("F32") instead, the same checkpoint loads the same state."""
    root = tmp_path / "root"
    shutil.copytree(fsdp2_on_2[0], root)
    path = root / step_dirname(1) / "manifest.json"
    manifest = decode_manifest(path.read_bytes())

    def as_code(name: str) -> str:
        dtype = decode_dtype(name)
        assert dtype is not None, name
        return encode_dtype(dtype, "code")

    components = {
        name: msgspec.structs.replace(
            entry,
            sharded={
                tensor: msgspec.structs.replace(sharded, dtype=as_code(sharded.dtype))
                for tensor, sharded in entry.sharded.items()
            },
        )
        for name, entry in manifest.components.items()
    }
    assert {s.dtype for e in manifest.components.values() for s in e.sharded.values()} == {
        "float32"
    }
    path.write_bytes(encode_manifest(msgspec.structs.replace(manifest, components=components)))
    expected = checkpointd.load(fsdp2_on_2[0]).state
    respelled = catalog.read_manifest(open_store(str(root)), 1)
    assert {s.dtype for e in respelled.components.values() for s in e.sharded.values()} == {"F32"}
    same(expected, checkpointd.load(str(root)).state)


def test_fsdp2_on_3_restores_on_2(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    saved = job("save", "fsdp2", root, tmp_path / "save", 3)
    check_restored(saved, job("restore", "fsdp2", root, tmp_path / "restore", 2))


def test_a_plain_process_checkpoint_restores_into_fsdp2_on_2(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    saved = job("save", "plain", root, tmp_path / "save", 1)
    assert catalog.read_manifest(open_store(root), 1).schema_version == 1
    check_restored(saved, job("restore", "fsdp2", root, tmp_path / "restore", 2))


def test_an_incremental_fsdp2_job_of_one_rank_restores_on_2(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    saved = job("save", "fsdp2", root, tmp_path / "save", 1, CHECKPOINTD_TEST_INCREMENTAL="1")
    assert catalog.read_manifest(open_store(root), 1).components["model"].sharded
    check_restored(saved, job("restore", "fsdp2", root, tmp_path / "restore", 2))


def test_hsdp_on_4_writes_each_shard_once_and_restores_into_fsdp2_on_2(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    saved = job("save", "hsdp", root, tmp_path / "save", 4)
    manifest = catalog.read_manifest(open_store(root), 1)
    for component in ("model", "optimizer"):
        for name, tensor in manifest.components[component].sharded.items():
            # Shard(0) over 2 ranks, replicated twice: two shards, not four.
            assert len(tensor.shards) == 2, name
    writers = {f.rank for f in manifest.files if ".rank" in f.path}
    assert writers == {0, 1, 2, 3}  # the replicas share the writing
    check_restored(saved, job("restore", "fsdp2", root, tmp_path / "restore", 2))


def test_tensor_parallel_on_2_restores_into_fsdp2_on_3(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    saved = job("save", "tp", root, tmp_path / "save", 2)
    check_restored(saved, job("restore", "fsdp2", root, tmp_path / "restore", 3))


def test_ddp_on_2_restores_into_a_plain_process(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    saved = job("save", "ddp", root, tmp_path / "save", 2)
    check_restored(saved, job("restore", "plain", root, tmp_path / "restore", 1))


def test_saves_that_cannot_hold_a_sharded_model_are_refused_at_save(tmp_path: Path) -> None:
    out = tmp_path / "out"
    reports = run_ranks(
        "tests.support.shard_job", ["refused", "fsdp2", str(tmp_path / "root"), str(out)], out, 2
    )
    for report in reports:
        assert report is not None
        assert report["ok"], report
        # a writer that saves alone would store half of each tensor
        assert report["local"][0] == "UnsupportedValueError"
        assert "spread over 2 ranks" in report["local"][1]
        # PerRank state is this rank's own: a DTensor's shards belong to the job
        assert report["per_rank"][0] == "UnsupportedValueError"
        assert "hold DTensors" in report["per_rank"][1]
    assert checkpointd.list_checkpoints(str(tmp_path / "root")) == []


def test_fsdp2_on_2_saves_to_s3_and_restores_on_3(moto_s3: MotoS3, tmp_path: Path) -> None:
    bucket = f"sharded-{tmp_path.name[-20:].lower().replace('_', '-')}"
    moto_s3.create_bucket(bucket)
    root = f"s3://{bucket}/run"
    options = {"CHECKPOINTD_TEST_OPTIONS": json.dumps(moto_s3.storage_options())}
    saved = job("save", "fsdp2", root, tmp_path / "save", 2, **options)
    check_restored(saved, job("restore", "fsdp2", root, tmp_path / "restore", 3, **options))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run(
        [sys.executable, "-m", "checkpointd", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_inspect_verify_and_export_a_sharded_checkpoint(
    fsdp2_on_2: tuple[str, Path], tmp_path: Path
) -> None:
    root, saved = fsdp2_on_2
    shown = _cli("inspect", root)
    assert shown.returncode == 0, shown.stderr
    assert "world size 2" in shown.stdout
    assert "[24, 16]" in shown.stdout
    assert "2 shards: rank 0 [0:12, 0:16], rank 1 [12:24, 0:16]" in shown.stdout
    checked = _cli("verify", root)
    assert checked.returncode == 0, checked.stderr + checked.stdout
    target = tmp_path / "model.safetensors"
    exported = _cli("export", root, "--component", "model", "--to", str(target))
    assert exported.returncode == 0, exported.stderr
    from safetensors.torch import load_file

    same(torch.load(saved / "save.pt")["model"], load_file(str(target)))


def test_odd_dtensors_reshard_into_other_placements(tmp_path: Path) -> None:
    """Empty shards (2 rows over 3 ranks), Shard(1), bool, bfloat16, a replicated
    scalar and a DTensor as a component: saved on 3 ranks, restored on 2 under other
    placements into a plain dict and a bare DTensor, and loaded whole in one process."""
    from tests.support.dtensor_job import full_state

    root = str(tmp_path / "root")
    saved = run_ranks(
        "tests.support.dtensor_job", ["save", root, str(tmp_path / "s")], tmp_path / "s", 3
    )
    assert all(r is not None and r["ok"] for r in saved), saved
    out = tmp_path / "r"
    restored = run_ranks("tests.support.dtensor_job", ["restore", root, str(out)], out, 2)
    for report in restored:
        assert report is not None
        assert report["ok"], report
        assert report["equal"] == dict.fromkeys([*full_state(), "whole"], True)
    loaded = checkpointd.load(root).state
    same(full_state(), loaded["t"])
    same(full_state()["col"], loaded["whole"])
