"""Many ranks, one checkpoint: real gloo groups of 2 processes (tests/support/rank_job.py).

Each test starts the ranks as subprocesses on a TCP store hosted by rank 0,
with short heartbeat/stale/join tunables (set in the job), and reads what each
rank saw from its report.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import torch

import checkpointd
from checkpointd.format.manifest import SCHEMA_VERSION, Manifest, decode_manifest, encode_manifest
from checkpointd.read import catalog
from checkpointd.storage import open_store
from tests.faults.helpers import same
from tests.support.launch import run_ranks
from tests.support.rank_job import Position, replicated_state


def run_job(
    scenario: str, root: Path, out: Path, world: int = 2, step: int = 1
) -> list[dict[str, Any] | None]:
    """Run ``world`` ranks of ``scenario``; return each rank's report (None if it wrote none)."""
    return run_ranks(
        "tests.support.rank_job", [scenario, str(root), str(out), str(step)], out, world
    )


def _seen(reports: list[dict[str, Any] | None], rank: int) -> dict[str, Any]:
    """What ``rank`` reported; fails if it wrote no report."""
    report = reports[rank]
    assert report is not None, reports
    return report


def _published(root: Path) -> list[int]:
    return [info.step for info in checkpointd.list_checkpoints(str(root))]


def test_replicated_save_spreads_files_over_ranks_and_loads_whole(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reports = run_job("replicated", tmp_path / "root", tmp_path / "out")
    assert [r and r["ok"] for r in reports] == [True, True], reports
    manifest = catalog.read_manifest(open_store(str(tmp_path / "root")), 1)
    assert manifest.world_size == 2
    # the follower's CheckpointInfo (from the publisher's summary) is the publisher's
    info = checkpointd.list_checkpoints(str(tmp_path / "root"))[0]
    whole = [info.step, info.nbytes, list(info.components), info.path]
    assert _seen(reports, 0)["info"] == _seen(reports, 1)["info"] == whole
    assert "loader-rank1" in whole[2]
    assert {f.rank for f in manifest.files} == {0, 1}  # the bytes are spread by size
    by_rank = [sum(f.size for f in manifest.files if f.rank == r) for r in (0, 1)]
    assert max(by_rank) < 0.7 * sum(by_rank)
    expected = replicated_state(0, "replicated")
    loaded = checkpointd.load(str(tmp_path / "root")).state
    model = expected["model"].state_dict()
    assert loaded["model"].keys() == model.keys()
    for name, tensor in model.items():
        assert torch.equal(loaded["model"][name], tensor)
    assert torch.equal(loaded["extra"]["table"], expected["extra"]["table"])
    assert loaded["extra"]["epoch"] == 3
    assert manifest.per_rank == {
        "loader": ["loader-rank0", "loader-rank1"],
        "rng": ["rng-rank0", "rng-rank1"],
    }
    assert loaded["loader-rank1"] == {"pos": 17}
    for rank in (0, 1):  # each rank got its own per-rank state back, its RNG exactly
        assert _seen(reports, rank)["loader"] == 10 * rank + 7
        assert _seen(reports, rank)["rng_exact"] is True
    # this process is one rank, the checkpoint has two: per-rank state is refused, or skipped
    with pytest.raises(checkpointd.RestoreMismatchError, match="saved by 2 ranks"):
        checkpointd.restore(str(tmp_path / "root"), {"loader": Position(0)})
    fresh = Position(0)
    with caplog.at_level(logging.WARNING, logger="checkpointd"):
        info = checkpointd.restore(str(tmp_path / "root"), {"loader": fresh}, strict=False)
    assert info.skipped_targets == ("loader",)
    assert fresh.pos == 0
    (message,) = [r.getMessage() for r in caplog.records if r.name == "checkpointd"]
    assert "without a component" not in message  # it has one, saved by another world size
    assert (
        "per-rank targets ['loader'] (their components were saved by 2 ranks, this job has 1)"
        in message
    )


def test_replicas_that_differ_fail_on_every_rank_naming_component_and_ranks(tmp_path: Path) -> None:
    reports = run_job("mismatch", tmp_path / "root", tmp_path / "out")
    for rank in (0, 1):
        report = _seen(reports, rank)
        assert report["error"] == "RankFailedError"
        assert "component 'extra' differs" in report["message"]
        assert "ranks [0]" in report["message"]
        assert "ranks [1]" in report["message"]
    assert _published(tmp_path / "root") == []


def test_a_rank_with_a_full_disk_fails_every_rank_typed(tmp_path: Path) -> None:
    reports = run_job("full_disk", tmp_path / "root", tmp_path / "out")
    assert _seen(reports, 1)["error"] == "StorageFullError"
    assert _seen(reports, 0)["error"] == "RankFailedError"
    assert "failed on rank 1: StorageFullError" in _seen(reports, 0)["message"]
    assert _published(tmp_path / "root") == []
    leftovers = list((tmp_path / "root").rglob("*.safetensors*"))
    assert leftovers == []  # every rank removed what it wrote


def test_a_rank_killed_while_writing_fails_the_others_and_a_restart_saves(tmp_path: Path) -> None:
    reports = run_job("killed", tmp_path / "root", tmp_path / "out")
    assert reports[1] is None  # SIGKILL: no report
    report = _seen(reports, 0)
    assert report["error"] == "RankFailedError"
    assert "rank(s) [1] stopped responding" in report["message"]
    assert report["seconds"] < 30  # liveness (stale after 3 s here), not a long deadline
    assert _published(tmp_path / "root") == []
    again = run_job("replicated", tmp_path / "root", tmp_path / "again")
    assert [r and r["ok"] for r in again] == [True, True], again
    assert _published(tmp_path / "root") == [1]


def test_rank_0_killed_while_writing_fails_the_others_typed(tmp_path: Path) -> None:
    # rank 0 hosts the TCP store and publishes: its death is a lost store, a typed error
    reports = run_job("killed0", tmp_path / "root", tmp_path / "out")
    assert reports[0] is None
    report = _seen(reports, 1)
    assert report["error"] == "RankFailedError"
    assert "store is unreachable" in report["message"]
    assert _published(tmp_path / "root") == []


def test_the_publisher_killed_during_the_commit_wait_publishes_nothing(tmp_path: Path) -> None:
    reports = run_job("killed0_publishing", tmp_path / "root", tmp_path / "out")
    assert reports[0] is None
    report = _seen(reports, 1)
    assert report["error"] == "RankFailedError"
    assert report["seconds"] < 60
    assert _published(tmp_path / "root") == []
    again = run_job("replicated", tmp_path / "root", tmp_path / "again")
    assert [r and r["ok"] for r in again] == [True, True], again
    assert _published(tmp_path / "root") == [1]


def test_sigterm_on_one_rank_makes_every_rank_save_the_same_step(tmp_path: Path) -> None:
    reports = run_job("preempted", tmp_path / "root", tmp_path / "out")
    seen = [_seen(reports, rank) for rank in (0, 1)]
    assert [r["stopped_at"] for r in seen] == [5, 5], seen
    assert [r["signalled"] for r in seen] == [False, True]  # only rank 1 got the signal
    assert _published(tmp_path / "root") == [5]
    assert checkpointd.load(str(tmp_path / "root")).state["extra"]["epoch"] == 5


def test_a_save_only_rank_0_joins_fails_naming_the_missing_rank(tmp_path: Path) -> None:
    reports = run_job("rank0_only", tmp_path / "root", tmp_path / "out")
    report = _seen(reports, 0)
    assert report["error"] == "RankFailedError"
    assert "rank(s) [1] did not join it" in report["message"]
    assert "process_group=checkpointd.LOCAL" in report["message"]
    assert _published(tmp_path / "root") == []


@pytest.mark.parametrize("how", ["uninitialized", "local"])
def test_a_writer_saves_alone_without_a_group_or_with_local(tmp_path: Path, how: str) -> None:
    kwargs: dict[str, Any] = {} if how == "uninitialized" else {"process_group": checkpointd.LOCAL}
    with checkpointd.CheckpointWriter(str(tmp_path), **kwargs) as writer:
        assert writer.world_size == 1
        state = {"x": {"t": torch.ones(3)}, "p": checkpointd.PerRank(Position(3))}
        info = writer.save(1, state).result()
    assert info.step == 1
    manifest = catalog.read_manifest(open_store(str(tmp_path)), 1)
    assert manifest.world_size == 1
    assert {f.rank for f in manifest.files} == {0}
    assert manifest.per_rank == {}  # alone, a PerRank component is an ordinary one
    assert checkpointd.load(str(tmp_path)).state["p"] == {"pos": 3}


def test_a_manifest_with_an_incomplete_per_rank_component_is_corrupt() -> None:
    manifest = Manifest(
        schema_version=SCHEMA_VERSION,
        step=1,
        created_at=datetime.now(UTC),
        library_version="0",
        components={},
        files=[],
        world_size=2,
        per_rank={"rng": ["rng-rank0"]},
    )
    with pytest.raises(checkpointd.CorruptCheckpointError, match="per-rank component 'rng'"):
        decode_manifest(encode_manifest(manifest))


def _readme_job(action: str, root: Path, out: Path, world: int, strict: str = "strict") -> Any:
    reports = run_ranks(
        "tests.support.readme_job", [action, str(root), str(out), strict], out, world
    )
    for rank, report in enumerate(reports):
        assert report is not None, (out / f"stderr{rank}.txt").read_text()[-3000:]
        assert report["ok"], report
    return reports


def test_the_readme_fsdp2_example_resumes_every_component_per_rank(tmp_path: Path) -> None:
    """The FSDP2 example (docs/ranks.md, the README): one state dict (FSDP2 model, optimizer, RNGState,
    PerRank(DistributedSampler)) saved on 2 ranks and restored as it is, strictly, on 2;
    on 3, strict=False restores model and optimizer and says why rng and loader were not."""
    root = tmp_path / "root"
    saved = _readme_job("save", root, tmp_path / "save", 2)
    restored = _readme_job("restore", root, tmp_path / "restore", 2)
    assert same(torch.load(tmp_path / "save/save.pt"), torch.load(tmp_path / "restore/restore.pt"))
    for rank in (0, 1):
        mine = {"model", "optimizer", f"rng-rank{rank}", f"loader-rank{rank}"}
        assert set(restored[rank]["restored"]) == mine  # the components, this rank's own
        assert (restored[rank]["epoch"], restored[rank]["seed"]) == (3, 5)
        assert restored[rank]["rand"] == saved[rank]["rand"]  # each rank's own generator
        assert restored[rank]["warnings"] == []
    assert saved[0]["rand"] != saved[1]["rand"]
    wider = _readme_job("restore", root, tmp_path / "wider", 3, "loose")
    assert same(torch.load(tmp_path / "save/save.pt"), torch.load(tmp_path / "wider/restore.pt"))
    for report in wider:
        assert set(report["restored"]) == {"model", "optimizer"}
        assert set(report["skipped_targets"]) == {"rng", "loader"}
        assert (report["epoch"], report["seed"]) == (0, 0)  # left as it was
        (warning,) = report["warnings"]
        assert "without a component" not in warning, warning
        assert "saved by 2 ranks, this job has 3" in warning, warning
