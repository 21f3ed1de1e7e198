"""The catalog scan: the newest checkpoint costs one manifest read, however long the history."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import checkpointd
from checkpointd.read import catalog
from checkpointd.read.catalog import CheckpointWarning
from checkpointd.storage import LocalStore, open_store

STEPS = range(1, 31)


@pytest.fixture
def root(tmp_path: Path) -> str:
    url = str(tmp_path / "ckpt")
    with checkpointd.CheckpointWriter(url) as writer:
        for step in STEPS:
            writer.save(step, {"m": {"w": torch.full((4,), float(step))}}).result(timeout=60)
    return url


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Steps whose manifest was read, in order."""
    calls: list[int] = []
    original = catalog.read_manifest

    def counted(store: Any, step: int) -> Any:
        calls.append(step)
        return original(store, step)

    monkeypatch.setattr(catalog, "read_manifest", counted)
    return calls


def test_load_newest_reads_one_manifest(root: str, reads: list[int]) -> None:
    loaded = checkpointd.load(root)
    assert loaded.info.step == STEPS[-1]
    assert torch.equal(loaded.state["m"]["w"], torch.full((4,), float(STEPS[-1])))
    assert reads == [STEPS[-1]]


def test_restore_newest_reads_its_manifest_once(root: str, reads: list[int]) -> None:
    target = {"w": torch.zeros(4)}
    info = checkpointd.restore(root, {"m": target})
    assert info.step == STEPS[-1]
    assert torch.equal(target["w"], torch.full((4,), float(STEPS[-1])))
    assert reads == [STEPS[-1]]


def test_damaged_newest_is_skipped_with_a_warning_then_one_more_read(
    root: str, reads: list[int]
) -> None:
    newest = Path(root, f"{STEPS[-1]:012d}", "manifest.json")
    newest.write_bytes(b"{not json")
    with pytest.warns(CheckpointWarning, match=f"skipping step {STEPS[-1]}"):
        loaded = checkpointd.load(root)
    assert loaded.info.step == STEPS[-2]
    assert reads == [STEPS[-1], STEPS[-2]]


def test_uncommitted_newest_folder_is_passed_over(root: str, reads: list[int]) -> None:
    Path(root, f"{STEPS[-1] + 1:012d}").mkdir()  # a save in progress
    assert checkpointd.load(root).info.step == STEPS[-1]
    assert reads == [STEPS[-1] + 1, STEPS[-1]]


def test_scan_is_lazy_and_ordered(root: str, reads: list[int]) -> None:
    store = open_store(root)
    try:
        scan = catalog.scan(store)
        assert [next(scan)[0], next(scan)[0]] == [STEPS[-1], STEPS[-2]]
        assert reads == [STEPS[-1], STEPS[-2]]
        assert [s for s, _ in catalog.scan(store, newest_first=False)] == list(STEPS)
    finally:
        store.close()


def test_list_checkpoints_reads_every_manifest(root: str, reads: list[int]) -> None:
    assert [c.step for c in checkpointd.list_checkpoints(root)] == list(STEPS)
    assert sorted(reads) == list(STEPS)


def test_a_writers_retention_reads_each_manifest_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention after every save used to decode every manifest of the root again."""
    root = str(tmp_path / "ckpt")
    reads: list[str] = []
    real_read_bytes = LocalStore.read_bytes

    def read_bytes(self: LocalStore, path: str, offset: int = 0, size: int | None = None) -> bytes:
        if path.endswith("manifest.json"):
            reads.append(path.partition("/")[0])
        return real_read_bytes(self, path, offset, size)

    monkeypatch.setattr(LocalStore, "read_bytes", read_bytes)
    with checkpointd.CheckpointWriter(root, keep_every=2) as writer:
        for step in range(1, 9):
            writer.save(step, {"w": torch.full((2,), float(step))}).result(timeout=60)
    assert sorted(reads) == [f"{step:012d}" for step in range(1, 9)]
    assert [i.step for i in checkpointd.list_checkpoints(root)] == [2, 4, 6, 8]


@pytest.mark.parametrize("newest_first", [True, False])
def test_a_step_deleted_after_its_listing_by_a_newer_commit_does_not_hide_the_newer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, newest_first: bool
) -> None:
    """keep_last=1 as it runs: the listing shows step 1 alone, then step 2 commits and
    retention deletes step 1 before its manifest is read. There was a committed
    checkpoint at every moment, so the reader must find step 2, not an empty root."""
    url = str(tmp_path / "ckpt")
    writer = checkpointd.CheckpointWriter(url, keep_last=1)
    writer.save(1, {"m": {"w": torch.ones(4)}}).result(timeout=60)
    original = catalog.read_manifest
    raced: list[int] = []

    def newer_commits_first(store: Any, step: int) -> Any:
        if not raced:
            raced.append(step)
            writer.save(2, {"m": {"w": torch.full((4,), 2.0)}}).result(timeout=60)
            writer.wait(timeout=60)  # step 1 is gone once its retention pass ran
        return original(store, step)

    monkeypatch.setattr(catalog, "read_manifest", newer_commits_first)
    try:
        store = open_store(url)
        try:
            found = [step for step, _ in catalog.scan(store, newest_first=newest_first)]
        finally:
            store.close()
    finally:
        writer.close()
    assert raced == [1]
    assert found == [2]
