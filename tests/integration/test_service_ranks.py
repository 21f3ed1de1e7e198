"""Many ranks through the checkpoint service: real gloo ranks, one real ``checkpointd
serve`` per rank (two "nodes"), the job's TCP store hosted by the test (as torchrun's
agent hosts it), and kill -9 of every rank after ``save()`` returned."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import checkpointd
from checkpointd.daemon.client.client import status
from checkpointd.read import catalog
from checkpointd.storage import open_store
from tests.support.launch import hosted_store
from tests.support.service import (
    Service,
    kill_ranks_at_line,
    rank_processes,
    services_per_rank,
    wait_ranks,
)
from tests.support.service_rank_job import rank_state

WORLD = 2


@pytest.fixture
def services() -> Iterator[list[Service]]:
    with services_per_rank(WORLD) as running:
        yield running


@pytest.fixture
def job_store() -> Iterator[int]:
    with hosted_store() as port:
        yield port


def _ranks(
    scenario: str, services: list[Service], root: Path, out: Path, *, steps: int, port: int
) -> list[subprocess.Popen[str]]:
    """One rank per service (tests.support.service_rank_job)."""
    return rank_processes(
        "tests.support.service_rank_job",
        services,
        out,
        port,
        before=[scenario],
        after=[str(root), str(out), str(steps)],
    )


def _committed_steps(root: Path) -> list[int]:
    return [c.step for c in checkpointd.list_checkpoints(str(root))] if root.is_dir() else []


def _wait_idle(services: list[Service], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while any(status(s.socket).saves_in_flight for s in services):
        assert time.monotonic() < deadline, [s.log_text() for s in services]
        time.sleep(0.05)


def _check_bit_exact(root: Path, step: int) -> None:
    loaded = checkpointd.load(str(root), step)
    expected = rank_state(step, 0)["model"]
    assert torch.equal(loaded.state["model"]["w"], expected["w"])
    assert loaded.state["model"]["step"] == step
    for rank in range(WORLD):
        assert loaded.state[f"mine-rank{rank}"] == {"rank": rank, "step": step}
    manifest = catalog.read_manifest(open_store(str(root)), step)
    assert manifest.world_size == WORLD


def test_ranks_save_through_their_services_with_one_outcome(
    services: list[Service], job_store: int, tmp_path: Path
) -> None:
    root, out = tmp_path / "root", tmp_path / "out"
    procs = _ranks("save", services, root, out, steps=2, port=job_store)
    wait_ranks(procs, out)
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert reports[0]["outcomes"] == reports[1]["outcomes"] == [["committed", 1], ["committed", 2]]
    assert _committed_steps(root) == [1, 2]
    for step in (1, 2):
        _check_bit_exact(root, step)
    # each service wrote its own rank's share: both wrote saves
    assert all(status(s.socket).committed == 2 for s in services)


def test_a_sub_group_saves_through_its_services(job_store: int, tmp_path: Path) -> None:
    """Ranks {1, 2} of 3 save their own checkpoint (a pipeline stage) through their
    services; rank 0 has no writer."""
    root, out = tmp_path / "root", tmp_path / "out"
    with services_per_rank(3) as services:
        procs = _ranks("stage", services, root, out, steps=2, port=job_store)
        wait_ranks(procs, out)
        reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]
        assert reports[0]["outcomes"] == []
        assert (
            reports[1]["outcomes"]
            == reports[2]["outcomes"]
            == [
                ["committed", 1],
                ["committed", 2],
            ]
        )
        assert [status(s.socket).committed for s in services] == [0, 2, 2]
    assert _committed_steps(root) == [1, 2]
    for step in (1, 2):
        loaded = checkpointd.load(str(root), step)
        assert torch.equal(loaded.state["model"]["w"], rank_state(step, 1)["model"]["w"])
        # the group's ranks 0 and 1 are the job's ranks 1 and 2
        assert loaded.state["mine-rank0"] == {"rank": 1, "step": step}
        assert loaded.state["mine-rank1"] == {"rank": 2, "step": step}
        assert catalog.read_manifest(open_store(str(root)), step).world_size == 2


def test_ranks_killed_after_save_returned_still_commit(job_store: int, tmp_path: Path) -> None:
    root, out, gate = tmp_path / "root", tmp_path / "out", tmp_path / "gate"
    steps = 3
    # Each service's writes wait for the gate: every save is in flight when the ranks die.
    with services_per_rank(WORLD, gate=str(gate)) as services:
        procs = _ranks("save", services, root, out, steps=steps, port=job_store)
        kill_ranks_at_line(procs, f"returned {steps}", out)  # every save() returned
        assert all(status(s.socket).saves_in_flight > 0 for s in services)
        assert _committed_steps(root) == []
        gate.touch()
        _wait_idle(services)
        assert _committed_steps(root) == list(range(1, steps + 1))
        for step in range(1, steps + 1):
            _check_bit_exact(root, step)
        assert all(status(s.socket).failed == 0 for s in services)


def test_a_rank_that_never_saves_abandons_the_save_everywhere(
    services: list[Service], job_store: int, tmp_path: Path
) -> None:
    root, out = tmp_path / "root", tmp_path / "out"
    procs = _ranks("absent", services, root, out, steps=1, port=job_store)
    wait_ranks(procs, out)
    (outcome,) = json.loads((out / "rank0.json").read_text())["outcomes"]
    assert outcome[0] == "RankFailedError"
    assert "closed their writer" in outcome[1]
    _wait_idle(services)
    assert _committed_steps(root) == []
    assert not any(os.scandir(root / f"{1:012d}")) if (root / f"{1:012d}").exists() else True


def test_a_rank_whose_service_dies_reports_the_same_outcome(job_store: int, tmp_path: Path) -> None:
    root, out, gate = tmp_path / "root", tmp_path / "out", tmp_path / "gate"
    with services_per_rank(WORLD, gate=str(gate)) as services:
        procs = _ranks("save", services, root, out, steps=1, port=job_store)
        for proc in procs:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.strip() == "returned 1":
                    break
        services[1].kill()  # rank 1's save dies with its service; its trainer lives
        gate.touch()
        wait_ranks(procs, out)
        outcomes = [
            json.loads((out / f"rank{r}.json").read_text())["outcomes"] for r in range(WORLD)
        ]
        assert [o[0][0] for o in outcomes] == ["RankFailedError"] * WORLD, outcomes
        assert "checkpoint service went away" in outcomes[0][0][1]
        _wait_idle(services[:1])
        assert _committed_steps(root) == []
