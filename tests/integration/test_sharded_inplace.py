"""FSDP2 restores read each rank's boxes straight into its local shards (read/boxes.py),
all or nothing: 2 real gloo ranks save (tests/support/inplace_job.py); 2 and 3 ranks
restore into the very tensors they hold, bit for bit; a damaged block, or a target that
refuses after the model and optimizer were loaded, leaves the rank as it was; a shard
file changed after the check pass is reported by the landing."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpointd.read import catalog
from checkpointd.storage import open_store
from tests.integration.test_sharded import same
from tests.support.launch import run_ranks


def _job(
    action: str, root: str, out: Path, world: int, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    args = [action, root, str(out)]
    reports = run_ranks("tests.support.inplace_job", args, out, world, env=env)
    for rank, report in enumerate(reports):
        assert report is not None, (out / f"stderr{rank}.txt").read_text()[-3000:]
    return reports  # type: ignore[return-value]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    base = tmp_path_factory.mktemp("inplace")
    root = str(base / "root")
    out = base / "save"
    assert all(r["ok"] for r in _job("save", root, out, 2))
    return root, out


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_restores_into_its_own_local_shards(
    saved: tuple[str, Path], tmp_path: Path, world: int
) -> None:
    root, out = saved
    reports = _job("restore", root, tmp_path / "restore", world)
    for report in reports:
        assert report["ok"], report
        assert report["same_memory"], report
        # the model's 4 tensors and the optimizer's 8 (exp_avg, exp_avg_sq) land directly
        assert report["landed"] == 12, report
    same(torch.load(out / "save.pt"), torch.load(tmp_path / "restore" / "restore.pt"))


def test_a_target_refusing_after_the_load_leaves_every_rank_as_it_was(
    saved: tuple[str, Path], tmp_path: Path
) -> None:
    reports = _job("refused", saved[0], tmp_path / "refused", 2)
    for report in reports:
        assert report["error"] == "RestoreMismatchError", report
        assert "injected" in report["message"]
        assert report["unchanged"], report
        assert report["same_memory"], report
        assert report["landed"] == 0, report


def test_a_damaged_last_block_leaves_the_rank_that_reads_it_as_it_was(
    saved: tuple[str, Path], tmp_path: Path
) -> None:
    root = tmp_path / "root"
    shutil.copytree(saved[0], root)
    manifest = catalog.read_manifest(open_store(str(root)), 1)
    # The last block of the optimizer's last shard of rank 1: read after every model box.
    shard = manifest.components["optimizer"].sharded["state/2.bias/exp_avg_sq"].shards[-1]
    path = root / "000000000001" / shard.file
    data = bytearray(path.read_bytes())
    data[shard.begin + 4 * 5 - 1] ^= 0x01
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    reports = _job("damaged", str(root), tmp_path / "damaged", 2)
    # Each rank reads only the shards its boxes overlap: rank 1 meets the damage.
    assert reports[0]["ok"], reports[0]
    assert reports[1]["error"] == "CorruptCheckpointError", reports[1]
    assert "CRC32C" in reports[1]["message"]
    assert reports[1]["unchanged"], reports[1]
    assert reports[1]["landed"] == 0, reports[1]


def test_a_shard_file_changed_after_the_check_pass_is_reported(
    saved: tuple[str, Path], tmp_path: Path
) -> None:
    root = tmp_path / "root"
    shutil.copytree(saved[0], root)
    reports = _job("scribble", str(root), tmp_path / "scribble", 2)
    for report in reports:
        assert report["error"] == "CorruptCheckpointError", report
        assert "changed while" in report["message"], report
        assert "'model'" in report["message"], report  # the component that may be part restored
        assert report["same_memory"], report


BOUNCED = {"CHECKPOINTD_TEST_BOUNCE": "100"}
"""Local shards through the bounce path (as CUDA ones), staging blocks of 100 bytes: the
256-byte shard blocks of the job are each read whole into a (grown) staging block."""


def test_local_shards_through_the_bounce_path_on_another_world_size(
    saved: tuple[str, Path], tmp_path: Path
) -> None:
    root, out = saved
    reports = _job("restore", root, tmp_path / "restore", 3, BOUNCED)
    for report in reports:
        assert report["ok"], report
        assert report["same_memory"], report
        assert report["landed"] == 12, report
        assert report["bounced"] > 0, report
    same(torch.load(out / "save.pt"), torch.load(tmp_path / "restore" / "restore.pt"))


def test_a_shard_file_changed_after_the_check_pass_is_reported_through_the_bounce_path(
    saved: tuple[str, Path], tmp_path: Path
) -> None:
    root = tmp_path / "root"
    shutil.copytree(saved[0], root)
    reports = _job("scribble", str(root), tmp_path / "scribble", 2, BOUNCED)
    for report in reports:
        assert report["error"] == "CorruptCheckpointError", report
        assert "changed while" in report["message"], report
        assert report["bounced"] > 0, report
