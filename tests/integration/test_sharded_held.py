"""FSDP2 local shards restored from the memory tier hold only bytes that were checked
(read/boxes.py on a ``MappedFile``): 2 real gloo ranks restore from a held copy built by
hand (tests/support/held_shard_job.py); a byte of each rank's own shard written into the
mapping right after it was first read from there must not reach the restored tensors:
the held copy fails as it lands and storage's checkpoint lands over it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.test_sharded import same
from tests.support.launch import run_ranks


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
