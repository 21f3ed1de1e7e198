"""A restarted job continues its own lineage: its retention prunes its previous run's
checkpoints as its own (keep_last holds across a restart), while writers that did not
resume from one another, or a predecessor still committing, keep their grace window."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import checkpointd
from checkpointd.read.catalog import read_manifest
from checkpointd.storage import open_store
from tests.conftest import Root


def _state(step: int) -> dict[str, Any]:
    return {"model": {"w": torch.full((4, 4), float(step))}}


def _visible(root: Root) -> list[int]:
    return [c.step for c in checkpointd.list_checkpoints(root.url)]


def _demo(root: Path, steps: int) -> str:
    done = subprocess.run(
        [
            *(sys.executable, "-m", "checkpointd", "demo", str(root), "--steps", str(steps)),
            *("--save-every", "10", "--width", "8", "--keep-last", "3"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_demo_run_twice_keeps_exactly_keep_last(tmp_path: Path) -> None:
    root = tmp_path / "demo"
    _demo(root, 100)
    assert [c.step for c in checkpointd.list_checkpoints(str(root))] == [80, 90, 100]
    _demo(root, 50)  # a new process: restores step 100, then saves 110..150
    assert [c.step for c in checkpointd.list_checkpoints(str(root))] == [130, 140, 150]


def test_a_writer_opened_after_a_restore_continues_that_lineage(local_root: Root) -> None:
    with checkpointd.CheckpointWriter(local_root.url, keep_last=3) as writer:
        for step in range(1, 6):
            writer.save(step, _state(step)).result(timeout=60)
    checkpointd.load(local_root.url)
    with checkpointd.CheckpointWriter(local_root.url, keep_last=3) as writer:
        writer.save(6, _state(6)).result(timeout=60)
        assert _visible(local_root) == [4, 5, 6]
    store = open_store(local_root.url)
    older, newer = read_manifest(store, 5), read_manifest(store, 6)
    assert older.writer != newer.writer  # another instance...
    assert newer.lineage == (older.lineage or older.writer)  # ...of the same lineage


def test_writers_resumed_from_one_checkpoint_spare_each_others_new_ones(
    local_root: Root,
) -> None:
    with checkpointd.CheckpointWriter(local_root.url, keep_last=1) as writer:
        writer.save(1, _state(1)).result(timeout=60)
        writer.save(2, _state(2)).result(timeout=60)
    checkpointd.load(local_root.url)  # step 2: both writers below resume from it
    with (
        checkpointd.CheckpointWriter(local_root.url, keep_last=1) as first,
        checkpointd.CheckpointWriter(local_root.url, keep_last=1) as second,
    ):
        first.save(3, _state(3)).result(timeout=60)
        assert _visible(local_root) == [3]  # step 2: the lineage's, up to the resumed step
        second.save(4, _state(4)).result(timeout=60)
        assert _visible(local_root) == [3, 4]  # 3 is first's, after the resumed step: kept
        first.save(5, _state(5)).result(timeout=60)
        assert _visible(local_root) == [4, 5]


def test_a_predecessor_that_still_commits_keeps_its_grace_window(local_root: Root) -> None:
    with checkpointd.CheckpointWriter(local_root.url, keep_last=3) as live:
        live.save(1, _state(1)).result(timeout=60)
        live.save(2, _state(2)).result(timeout=60)
        checkpointd.load(local_root.url)  # resumes from step 2 while its writer lives on
        with checkpointd.CheckpointWriter(local_root.url, keep_last=1) as resumed:
            live.save(3, _state(3)).result(timeout=60)  # it commits after the resume: live
            resumed.save(4, _state(4)).result(timeout=60)
            assert _visible(local_root) == [1, 2, 3, 4]
