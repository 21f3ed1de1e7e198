"""Checkpoints saved by a sub-group (``process_group=`` a ``new_group``), on real gloo
groups of 3 and 4 processes (tests/support/group_job.py): a pipeline stage of ranks
{1, 2} saves and restores its own checkpoint while rank 0, outside it, trains on
(world all-reduces) with no writer of that root; the stage's checkpoint reshards onto
the whole world and loads in a plain process; two disjoint groups save their own roots
at the same time through the job's one store, one attempt abandoned in one group only,
and each group agrees on preemption by itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import checkpointd
from checkpointd.read import catalog
from checkpointd.storage import open_store
from tests.faults.helpers import same
from tests.support.launch import run_ranks


def job(scenario: str, root: Path, out: Path, world: int) -> list[dict[str, Any]]:
    """Run ``world`` ranks of group_job ``scenario``; every rank must report ``ok``."""
    reports = run_ranks("tests.support.group_job", [scenario, str(root), str(out)], out, world)
    for rank, report in enumerate(reports):
        assert report is not None, (out / f"stderr{rank}.txt").read_text()[-3000:]
        assert report["ok"], report
    return [r for r in reports if r is not None]


@pytest.fixture(scope="module")
def stage(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[dict[str, Any]]]:
    """Ranks {1, 2} of 3 saved step 1 with their own group: (root, out, reports)."""
    base = tmp_path_factory.mktemp("stage")
    reports = job("stage", base / "root", base / "out", 3)
    return base / "root", base / "out", reports


def test_a_pipeline_stage_saves_and_restores_its_own_checkpoint(
    stage: tuple[Path, Path, list[dict[str, Any]]],
) -> None:
    root, _, reports = stage
    outside, *members = reports
    # rank 0 is not in the group: it may not make the stage's writer, and it needs none
    assert outside["refused"][0] == "InvalidArgumentError"
    assert "not a member of process_group" in outside["refused"][1]
    for report in reports:  # the world's collectives went on around the save
        assert report["sum"] == 20 * 3
    assert [info.step for info in checkpointd.list_checkpoints(str(root))] == [1]
    assert [info.step for info in checkpointd.list_checkpoints(f"{root}-rank0")] == [5]
    manifest = catalog.read_manifest(open_store(str(root)), 1)
    assert manifest.world_size == 2  # the group's ranks, numbered in the group
    assert {f.rank for f in manifest.files} == {0, 1}
    assert manifest.per_rank == {
        "loader": ["loader-rank0", "loader-rank1"],
        "rng": ["rng-rank0", "rng-rank1"],
    }
    for global_rank, report in zip((1, 2), members, strict=True):
        assert report["step"] == 1
        assert report["exact"] is True  # model and optimizer, gathered, bit for bit
        assert report["progress"] == {"epoch": 3}
        assert report["loader"] == 10 * global_rank + 7  # its own per-rank state
        assert report["rng_exact"] is True
        # restored without the group, this rank is one of 3: its per-rank state is refused
        assert "saved by 2 ranks and this job has 3" in report["without_group"]


def test_a_stage_checkpoint_reshards_onto_the_world_and_loads_whole(
    stage: tuple[Path, Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    root, saved_out, _ = stage
    saved = torch.load(saved_out / "save.pt")
    job("reshard", root, tmp_path, 3)  # FSDP2 on all 3 ranks
    assert same(saved, torch.load(tmp_path / "restore.pt"))
    loaded = checkpointd.load(str(root)).state  # one plain process
    assert same(saved["model"], loaded["model"])
    assert same(saved["optimizer"], loaded["optimizer"]["state"])


def test_two_groups_save_their_own_roots_at_once_through_one_store(tmp_path: Path) -> None:
    reports = job("pairs", tmp_path / "root", tmp_path / "out", 4)
    steps = [{int(k): v for k, v in r["steps"].items()} for r in reports]
    for rank in (0, 1, 2, 3):
        assert steps[rank][1][0] == "ok", steps[rank]
        assert steps[rank][3][0] == "ok", steps[rank]
    # {0, 1} committed step 2; in {2, 3}, rank 3 refused it and rank 2 followed at once
    assert steps[0][2][0] == steps[1][2][0] == "ok"
    assert steps[3][2][0] == "UnsupportedValueError"
    error, message, seconds = steps[2][2]
    assert error == "RankFailedError"
    assert "rank 1 (global 3): its save() was refused" in message
    assert seconds < 10  # the job's JOIN_SECONDS is 30: it did not wait for a join
    # preemption is agreed within each group (its own all_reduce), not over the world
    assert [r["stopped_at"] for r in reports] == [6, 6, 8, 8]
    for name, group, committed in (("a", 0, [1, 2, 3, 6]), ("b", 1, [1, 3, 8])):
        root = str(tmp_path / "root" / name)
        assert [info.step for info in checkpointd.list_checkpoints(root)] == committed
        torch.manual_seed(group)
        expected = torch.nn.Linear(32, 16).state_dict()
        for step in committed:
            manifest = catalog.read_manifest(open_store(root), step)
            assert manifest.world_size == 2
            state = checkpointd.load(root, step).state
            assert state["extra"] == {"group": group, "step": step}
            assert same(expected, state["model"])
