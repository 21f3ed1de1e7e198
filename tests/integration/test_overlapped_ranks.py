"""Overlapped staging with many ranks: 2 real gloo ranks (tests/support/overlap_job.py)
save FSDP2 and DDP state with ``staging="overlapped"`` while they train on, and a
failed background copy on one rank fails the save on both, publishing nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import checkpointd
from checkpointd.read import catalog
from checkpointd.storage import open_store
from tests.support.launch import run_ranks


def job(scenario: str, root: Path, out: Path) -> list[dict[str, Any]]:
    reports = run_ranks("tests.support.overlap_job", [scenario, str(root), str(out)], out, 2)
    for rank, report in enumerate(reports):
        assert report is not None, (out / f"stderr{rank}.txt").read_text()[-3000:]
        assert report["ok"], report
    return [r for r in reports if r is not None]


def test_fsdp2_and_ddp_save_while_training_and_restore_bit_exact(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for report in job("train", root, tmp_path / "out"):
        # save() returned, and a forward and backward ran, while the copy was held
        assert report["staged_at_return"] is False
        assert report["staged_after_backward"] is False
        # what was copied in the background: every optimized tensor of this rank
        assert report["held_bytes"] == report["guarded_bytes"] > 0
        assert report["moved_on"] is True  # the optimizers stepped on after save()
        assert report["exact"] is True  # fresh models restored the state at save()
    manifest = catalog.read_manifest(open_store(str(root)), 1)
    assert manifest.world_size == 2
    assert manifest.components["fsdp"].sharded  # FSDP2: stored as shards
    assert not manifest.components["ddp"].sharded  # DDP: replicated, written once


def test_a_failed_background_copy_on_one_rank_fails_both_and_publishes_nothing(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    first, second = job("fail", root, tmp_path / "out")
    assert second["error"] == "StagingError"
    assert "injected: the background copy failed" in second["message"]
    assert first["error"] == "RankFailedError"
    assert "rank 1: its staging failed" in first["message"]
    assert "nothing was published" in first["message"]
    for report in (first, second):
        assert report["published"] == []
        assert report["seconds"] < 10  # the job's JOIN_SECONDS is 30: rank 0 did not wait
        assert report["retry"] == 2  # the next save of both ranks commits
    assert [info.step for info in checkpointd.list_checkpoints(str(root))] == [2]
