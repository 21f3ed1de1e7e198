"""Retention through the writer, and a crash in the middle of it, on every backend.

The crash is injected by a Store wrapper around the real store: the deletion of
a victim fails at its manifest, right after it, or half-way through its files.
Whatever the point, readers must never see a half-deleted checkpoint.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import pytest
import torch

import checkpointd
from checkpointd.errors import CheckpointNotFoundError
from checkpointd.format.manifest import MANIFEST_NAME
from checkpointd.maintain.cleanup import find_leftovers, remove_leftovers
from checkpointd.maintain.retention import RetentionPolicy, RetentionWarning, apply_retention
from checkpointd.storage import Capabilities, FileSink, PendingUpload, Store, open_store
from tests.conftest import Root


def state(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(64, 8, generator=gen)}, "meta": {"step": step}}


def visible(root: Root) -> list[int]:
    return [c.step for c in checkpointd.list_checkpoints(root.url, **options(root))]


def options(root: Root) -> dict[str, Any]:
    return {"storage_options": root.storage_options}


def folders(root: Root) -> list[str]:
    store = open_store(root.url, root.storage_options)
    try:
        return store.list_dir("")
    finally:
        store.close()


def save_all(root: Root, steps: list[int], **policy: Any) -> None:
    with checkpointd.CheckpointWriter(root.url, **options(root), **policy) as writer:
        for step in steps:
            writer.save(step, state(step), metrics={"loss": 1.0 / (step + 1)}).result(timeout=60)


def assert_loads_intact(root: Root, step: int) -> None:
    loaded = checkpointd.load(root.url, step, verify=True, **options(root))
    assert torch.equal(loaded.state["model"]["w"], state(step)["model"]["w"])


def test_writer_keeps_the_union_of_its_rules_and_removes_whole_folders(any_root: Root) -> None:
    save_all(any_root, list(range(1, 6)), keep_last=1, keep_every=2)
    assert visible(any_root) == [2, 4, 5]
    # Deleted checkpoints leave nothing behind: not even an empty folder.
    assert [f for f in folders(any_root) if f.isdigit()] == [f"{s:012d}" for s in (2, 4, 5)]
    for step in (2, 4, 5):
        assert_loads_intact(any_root, step)


def test_saving_an_older_step_than_the_newest_does_not_delete_it(local_root: Root) -> None:
    with checkpointd.CheckpointWriter(local_root.url, keep_last=1, newer_steps="keep") as writer:
        writer.save(100, state(100)).result(timeout=60)
        info = writer.save(50, state(50)).result(timeout=60)
        assert visible(local_root) == [50, 100]  # 100 is the newest, 50 was just committed
        assert_loads_intact(local_root, info.step)
        writer.save(60, state(60)).result(timeout=60)
    assert visible(local_root) == [60, 100]


def test_missing_best_metric_warns_once_and_keeps_only_by_other_rules(local_root: Root) -> None:
    policy = {"keep_best": 1, "best_metric": "loss", "keep_last": 1}
    with checkpointd.CheckpointWriter(local_root.url, **policy) as writer:
        writer.save(1, state(1), metrics={"loss": 0.1}).result(timeout=60)
        with pytest.warns(RetentionWarning, match=r"step 2 has no numeric metric 'loss'") as seen:
            writer.save(2, state(2)).result(timeout=60)
        assert len(seen) == 1
        assert visible(local_root) == [1, 2]  # 1: best; 2: newest
        writer.save(3, state(3), metrics={"loss": 0.5}).result(timeout=60)  # no warning
    assert visible(local_root) == [1, 3]  # 2 was only ever kept for being newest


def test_retention_never_leaves_the_root_without_a_checkpoint_while_saves_are_in_flight(
    local_root: Root,
) -> None:
    """keep_last=1 with two saves in flight: a reader must always find a committed one."""
    empty_after_first: list[float] = []
    polls_after_first = 0
    stop = threading.Event()
    first_commit = threading.Event()

    def poll() -> None:
        nonlocal polls_after_first
        while not stop.is_set():
            after_first = first_commit.is_set()
            found = visible(local_root)
            if after_first:
                polls_after_first += 1
                if not found:
                    empty_after_first.append(time.monotonic())

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        with checkpointd.CheckpointWriter(local_root.url, keep_last=1, max_pending=2) as writer:
            handles = []
            for step in range(1, 9):
                handles.append(writer.save(step, state(step)))
                if step == 1:
                    handles[0].result(timeout=60)
                    first_commit.set()
            writer.wait(timeout=60)
    finally:
        stop.set()
        poller.join()
    assert polls_after_first > 0
    assert empty_after_first == []
    assert visible(local_root) == [8]


def test_writers_sharing_a_root_never_delete_each_others_fresh_checkpoints(
    local_root: Root,
) -> None:
    """Two writers with keep_last=1: each prunes its own old steps, not the other's new one."""
    with (
        checkpointd.CheckpointWriter(local_root.url, keep_last=1) as first,
        checkpointd.CheckpointWriter(local_root.url, keep_last=1) as second,
    ):
        first.save(1, state(1)).result(timeout=60)
        second.save(2, state(2)).result(timeout=60)
        first.save(3, state(3)).result(timeout=60)  # 1 is its own: gone; 2 is second's: kept
        assert visible(local_root) == [2, 3]
        second.save(4, state(4)).result(timeout=60)  # 2 is its own: gone; 3 is first's: kept
        assert visible(local_root) == [3, 4]
    for step in (3, 4):
        assert_loads_intact(local_root, step)


# --- a crash in the middle of retention ----------------------------------------


class InjectedFault(Exception):
    """The simulated crash of the process running retention."""


class CrashingStore(Store):
    """Delegates to a real store; dies at a chosen point of deleting a checkpoint."""

    def __init__(self, inner: Store, point: str) -> None:
        self.inner = inner
        self.url = inner.url
        self.point = point
        self.dead = False

    def _die(self) -> None:
        self.dead = True
        raise InjectedFault(self.point)

    def _alive(self) -> None:
        if self.dead:
            raise InjectedFault("call after the crash")

    def remove_file(self, path: str) -> None:
        self._alive()
        if path.endswith(MANIFEST_NAME) and self.point == "at-manifest":
            self._die()
        self.inner.remove_file(path)

    def remove_dir(self, path: str) -> None:
        self._alive()
        if self.point == "after-manifest":
            self._die()
        if self.point == "mid-folder":
            names = self.inner.list_dir(path)
            assert names, "the folder should still hold its component files"
            for name in names[: max(1, len(names) // 2)]:
                self.inner.remove_file(f"{path}/{name}")
            self._die()
        self.inner.remove_dir(path)

    # Plain delegation for everything else.
    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    def make_dir(self, path: str) -> None:
        self._alive()
        self.inner.make_dir(path)

    def open_file(self, path: str, size: int | None = None) -> FileSink:
        self._alive()
        return self.inner.open_file(path, size)

    def sync_dir(self, path: str) -> None:
        self.inner.sync_dir(path)

    def publish(self, path: str, data: bytes) -> None:
        self._alive()
        self.inner.publish(path, data)

    def read_into(self, path: str, buffer: memoryview, offset: int = 0) -> None:
        self.inner.read_into(path, buffer, offset)

    def size(self, path: str) -> int:
        return self.inner.size(path)

    def list_dir(self, path: str) -> list[str]:
        return self.inner.list_dir(path)

    def modified(self, path: str) -> float | None:
        return self.inner.modified(path)

    def pending_uploads(self) -> list[PendingUpload]:
        return self.inner.pending_uploads()

    def abort_upload(self, upload: PendingUpload) -> None:
        self.inner.abort_upload(upload)


CRASH_CASES = [
    (kind, point)
    for kind in ("memory", "local", "s3")
    for point in ("at-manifest", "after-manifest", "mid-folder")
    if kind != "s3" or point == "mid-folder"  # S3 over moto is slow; its hardest case only
]


@pytest.mark.parametrize(("kind", "point"), CRASH_CASES)
def test_crash_mid_retention_leaves_nothing_a_reader_could_mistake(
    request: pytest.FixtureRequest, kind: str, point: str
) -> None:
    root: Root = request.getfixturevalue(f"{kind}_root")
    save_all(root, [1, 2, 3])  # no retention while saving
    store = CrashingStore(open_store(root.url, root.storage_options), point)
    policy = RetentionPolicy(keep_last=1)

    async def retention() -> list[int]:
        return await apply_retention(store, policy, anyio.CapacityLimiter(2), committed_step=3)

    with pytest.raises(InjectedFault):
        anyio.run(retention)

    if point == "at-manifest":
        # Died before the first delete: every checkpoint is whole.
        assert visible(root) == [1, 2, 3]
        assert_loads_intact(root, 1)
    else:
        # Step 1's manifest is gone: whatever is left of it is not a checkpoint.
        assert visible(root) == [2, 3]
        with pytest.raises(CheckpointNotFoundError):
            checkpointd.load(root.url, 1, **options(root))
        assert "000000000001" in folders(root)  # its remains are still there for gc
    assert checkpointd.load(root.url, **options(root)).info.step == 3
    assert_loads_intact(root, 2)
    assert_loads_intact(root, 3)

    # After the "restart": gc removes the remains, and the next retention pass completes.
    fresh = open_store(root.url, root.storage_options)
    try:
        leftovers = find_leftovers(fresh, older_than=0)
        expected = [] if point == "at-manifest" else ["000000000001"]
        assert [x.path for x in leftovers if x.kind == "uncommitted"] == expected
        remove_leftovers(fresh, leftovers)

        async def again() -> list[int]:
            return await apply_retention(fresh, policy, anyio.CapacityLimiter(2), committed_step=3)

        deleted = anyio.run(again)
    finally:
        fresh.close()
    assert deleted == ([1, 2] if point == "at-manifest" else [2])
    assert visible(root) == [3]
    assert [f for f in folders(root) if f.isdigit()] == ["000000000003"]


# --- keep_last across a restart, however the writer resumes ----------------------


@pytest.mark.parametrize("resume", ["restore-then-writer", "writer.restore", "writer-then-restore"])
def test_keep_last_holds_across_a_restart_whichever_way_the_job_restores(
    local_root: Root, resume: str
) -> None:
    """A restarted job (a new writer instance) prunes its previous run's checkpoints as
    its own whether it restored before making its writer or through it."""
    save_all(local_root, [1, 2], keep_last=2)  # the previous run
    target = {"model": {"w": torch.zeros(64, 8)}, "meta": {"step": -1}}
    if resume == "restore-then-writer":
        checkpointd.restore(local_root.url, target)
    with checkpointd.CheckpointWriter(local_root.url, keep_last=2) as writer:
        if resume == "writer.restore":
            writer.restore(target)
        elif resume == "writer-then-restore":
            checkpointd.restore(local_root.url, target)
        assert torch.equal(target["model"]["w"], state(2)["model"]["w"])
        writer.save(3, state(3)).result(timeout=60)
        writer.save(4, state(4)).result(timeout=60)
        assert visible(local_root) == [3, 4]


def test_a_writer_that_restores_after_saving_keeps_its_lineage(local_root: Root) -> None:
    """Only a writer that has committed nothing takes on a restored lineage: a later
    restore (evaluating an old step) leaves the lineage its manifests record alone."""
    save_all(local_root, [1])  # another run, no retention
    with checkpointd.CheckpointWriter(local_root.url, keep_last=1) as writer:
        writer.save(2, state(2)).result(timeout=60)
        assert visible(local_root) == [1, 2]  # 1: another writer's, in its grace window
        checkpointd.load(local_root.url, 1)
        writer.save(3, state(3)).result(timeout=60)
        assert visible(local_root) == [1, 3]
