"""CheckpointdIO's removal of replaced roots under SIGKILL: never a torn checkpoint, and a
removal the kill cut short (deferred or half done) is finished by the next run or by gc,
on local disk and on S3."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("pytorch_lightning")

import checkpointd
from checkpointd.format.layout import MANIFEST_NAME, step_dirname
from checkpointd.integrations.lightning import CheckpointdIO
from checkpointd.maintain.removal import MARKER_NAME, Awaited, due, mark_root, read_removal
from checkpointd.read import catalog
from checkpointd.storage import open_store
from tests.conftest import Root
from tests.integration.test_cli import run

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated"),
    pytest.mark.filterwarnings("ignore::lightning_fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
]

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
TOP_K = {"save_top_k": 2, "monitor": "score", "mode": "min", "every_n_train_steps": 1}


def _newest_last(dirpath: Path) -> int:
    infos = (
        catalog.list_checkpoints(str(dirpath / "last.ckpt"))
        if (dirpath / "last.ckpt").exists()
        else []
    )
    return infos[-1].step if infos else -1


def _fit_until_stopped(dirpath: Path, mode: str, more_steps: int = 0) -> dict[str, Any]:
    """Run the job until its deletion thread stops at ``mode``'s point (and last.ckpt has
    ``more_steps`` more saves after that), then SIGKILL it; what it stopped at."""
    stopped = dirpath.parent / f"{dirpath.name}.stopped"
    kwargs = json.dumps({"max_epochs": 1000, "checkpoint": {**TOP_K, "save_last": True}})
    cmd = [sys.executable, "-m", "tests.support.lightning_kill_job", mode, str(stopped)]
    proc = subprocess.Popen(
        [*cmd, str(dirpath), "--kwargs", kwargs],
        cwd=REPO,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not stopped.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stopped.exists(), "the job never reached the stop point"
        at = _newest_last(dirpath)
        while _newest_last(dirpath) < at + more_steps and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    what: dict[str, Any] = json.loads(stopped.read_text())
    return what


def _assert_nothing_torn(dirpath: Path) -> None:
    """Every step folder that still has a manifest loads and verifies."""
    for root in sorted(dirpath.iterdir()):
        if root.is_symlink() or not root.is_dir():
            continue
        for step in catalog.step_folders(open_store(str(root))):
            if (root / step_dirname(step) / MANIFEST_NAME).exists():
                checkpointd.load(str(root), step, verify=True)


def _top_k_roots(dirpath: Path) -> set[str]:
    """The top-k roots (not last.ckpt) holding a committed checkpoint."""
    return {
        r.name
        for r in dirpath.iterdir()
        if r.is_dir() and not r.name.startswith("last") and catalog.list_checkpoints(str(r))
    }


def _finish(dirpath: Path, how: str, root: Root | None = None) -> None:
    if how == "next run":
        io = CheckpointdIO(restore_rng=False, storage_options=root and root.storage_options)
        io.load_checkpoint(f"{root.url if root else dirpath}/last.ckpt")
        io.teardown()
    elif root is not None:
        assert "  remove  " in run(root, "gc", root.url, "--apply").stdout
    else:
        done = subprocess.run(
            [sys.executable, "-m", "checkpointd", "gc", str(dirpath), "--apply"],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert "  remove  " in done.stdout


def test_kill9_mid_removal_leaves_nothing_torn_and_the_next_run_finishes_it(
    tmp_path: Path,
) -> None:
    dirpath = tmp_path / "run"
    stopped = _fit_until_stopped(dirpath, "unlink")
    _assert_nothing_torn(dirpath)
    half_done = Path(stopped["folder"]).parent
    assert half_done.exists()
    _finish(dirpath, "next run")
    assert not half_done.exists()
    _assert_nothing_torn(dirpath)


@pytest.mark.parametrize("how", ["next run", "gc"])
def test_a_deferred_removal_cut_short_by_kill9_is_finished(tmp_path: Path, how: str) -> None:
    dirpath = tmp_path / "run"
    stopped = _fit_until_stopped(dirpath, "delete", more_steps=3)
    _assert_nothing_torn(dirpath)
    assert Path(stopped["root"]).exists()  # the removal Lightning asked for never ran
    _finish(dirpath, how)
    _assert_nothing_torn(dirpath)
    assert not Path(stopped["root"]).exists()
    waiting = set()  # removals still waiting for a save the kill cut short: rightly kept
    for name in _top_k_roots(dirpath):
        removal = read_removal(open_store(str(dirpath / name)))
        if removal is not None:
            assert not due(removal)
            waiting.add(name)
    assert len(_top_k_roots(dirpath) - waiting) <= 2  # save_top_k=2


@pytest.mark.parametrize("how", ["next run", "gc"])
def test_s3_removal_cut_short_is_finished(s3_root: Root, how: str) -> None:
    options = s3_root.storage_options
    io = CheckpointdIO(storage_options=options, restore_rng=False)
    old, last = f"{s3_root.url}/epoch=0-step=1.ckpt", f"{s3_root.url}/last.ckpt"
    io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.ones(4)}}, old)
    io.save_checkpoint({"global_step": 2, "state_dict": {"w": torch.ones(4)}}, last)
    io.teardown()
    # What a kill between the manifest's deletion and the files' leaves behind.
    assert mark_root(old, [Awaited(last, 2)], options)
    store = open_store(old, options)
    store.remove_file(f"{step_dirname(1)}/{MANIFEST_NAME}")
    assert store.list_dir("") == [step_dirname(1), MARKER_NAME]
    _finish(Path(), how, s3_root)
    assert open_store(old, options).list_dir("") == []
    assert catalog.list_checkpoints(last, storage_options=options)[-1].step == 2


def test_s3_removal_deletes_manifest_first_through_the_store(s3_root: Root) -> None:
    options = s3_root.storage_options
    io = CheckpointdIO(storage_options=options, restore_rng=False)
    old, last = f"{s3_root.url}/epoch=0-step=1.ckpt", f"{s3_root.url}/last.ckpt"
    io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.ones(4)}}, old)
    io.save_checkpoint({"global_step": 2, "state_dict": {"w": torch.ones(4)}}, last)
    removed: list[str] = []
    from checkpointd.storage import S3Store

    real = S3Store.remove_file

    def remove_file(self: S3Store, path: str) -> None:
        removed.append(path)
        real(self, path)

    S3Store.remove_file = remove_file  # type: ignore[method-assign]
    try:
        io.remove_checkpoint(old)
        io.teardown()
    finally:
        S3Store.remove_file = real  # type: ignore[method-assign]
    assert removed[0] == f"{step_dirname(1)}/{MANIFEST_NAME}"
    assert open_store(old, options).list_dir("") == []
