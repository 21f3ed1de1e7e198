"""FSDP2 local shards restored from the memory tier hold only bytes that were checked
(read/boxes.py on a ``MappedFile``): 2 real gloo ranks restore from a held copy built by
hand (tests/support/held_shard_job.py); a byte of each rank's own shard written into the
mapping right after it was first read from there must not reach the restored tensors:
the held copy fails as it lands and storage's checkpoint lands over it. The same with
real services, the byte written into each service's segment right after the check pass
(tests/support/held_flip_job.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.test_service_sharded_memory import _settled
from tests.integration.test_sharded import BLOCK, check_restored, job, same
from tests.support.launch import run_ranks
from tests.support.service import services_per_rank


def _job(module: str, action: str, root: str, out: Path) -> list[dict[str, Any]]:
    reports = run_ranks(module, [action, root, str(out)], out, 2)
    for rank, report in enumerate(reports):
        assert report is not None, (out / f"stderr{rank}.txt").read_text()[-3000:]
    return reports  # type: ignore[return-value]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    base = tmp_path_factory.mktemp("held")
    root = str(base / "root")
    out = base / "save"
    assert all(r["ok"] for r in _job("tests.support.inplace_job", "save", root, out))
    return root, out


def test_an_intact_held_copy_lands_in_the_local_shards_from_memory(
    saved: tuple[str, Path], tmp_path: Path
) -> None:
    root, out = saved
    reports = _job("tests.support.held_shard_job", "intact", root, tmp_path)
    for report in reports:
        assert report["ok"], report
        assert report["source"] == "memory", report
        assert report["landed"] == 12, report  # the model's 4 tensors, the optimizer's 8
    same(torch.load(out / "save.pt"), torch.load(tmp_path / "intact.pt"))


def test_a_held_shard_written_into_after_it_was_read_is_restored_from_storage(
    saved: tuple[str, Path], tmp_path: Path
) -> None:
    root, out = saved
    reports = _job("tests.support.held_shard_job", "flip", root, tmp_path)
    for report in reports:
        assert report["ok"], report
        assert report["flips"] == 1, report
        assert report["source"] == "storage", report
    same(torch.load(out / "save.pt"), torch.load(tmp_path / "flip.pt"))


@pytest.mark.timeout(300)
def test_a_service_segment_written_into_after_the_check_pass_is_never_used(
    tmp_path: Path,
) -> None:
    """2 ranks save through their own real services, then restore from them; right after
    each rank's check pass a byte of its own held shard is flipped in its service's
    segment (through the memfd): each rank reads storage instead, bit for bit."""
    root = str(tmp_path / "root")
    with services_per_rank(2) as services:
        sockets = ",".join(s.socket for s in services)
        saved = job("save", "fsdp2", root, tmp_path / "save", 2, CHECKPOINTD_TEST_SERVICES=sockets)
        _settled(services, 1)
        out = tmp_path / "restore"
        env = {
            "CHECKPOINTD_TEST_BLOCK": str(BLOCK),
            "CHECKPOINTD_TEST_SERVICES": sockets,
            "CHECKPOINTD_TEST_SERVICE_PIDS": ",".join(str(s.proc.pid) for s in services),
        }
        args = ["restore", "fsdp2", root, str(out)]
        reports = run_ranks("tests.support.held_flip_job", args, out, 2, env=env)
    for rank, report in enumerate(reports):
        assert report is not None, (out / f"stderr{rank}.txt").read_text()[-3000:]
        assert report["ok"], report
        assert json.loads((out / f"flipped{rank}.json").read_text()) >= 1
        assert report["source"] == "storage", report
    check_restored(saved, out)
