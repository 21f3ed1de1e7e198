"""Incremental saves with many ranks: a frozen base sharded by FSDP2 over 2 real gloo
ranks, LoRA-like adapters that train between saves (tests/support/lora_job.py). Each
rank's unchanged shards are referenced as shared blobs, not rewritten; every step
restores bit for bit; retention (keep_last=2) and gc keep every blob a committed
manifest uses and remove the rest."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import checkpointd
from checkpointd import tunables
from checkpointd.format.layout import BLOBS_DIR
from checkpointd.maintain.gc import apply_gc, plan_gc
from checkpointd.maintain.retention import RetentionPolicy
from checkpointd.read import catalog
from checkpointd.read.verify import verify_step
from checkpointd.storage import open_store
from tests.support.launch import run_ranks


def job(action: str, root: Path, out: Path, world: int, **env: str) -> list[dict[str, Any]]:
    reports = run_ranks(
        "tests.support.lora_job", [action, str(root), str(out)], out, world, env=env
    )
    for rank, report in enumerate(reports):
        assert report is not None, (out / f"stderr{rank}.txt").read_text()[-3000:]
        assert report["ok"], report
    return [r for r in reports if r is not None]


def _tensors(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    out: dict[str, torch.Tensor] = {}
    if isinstance(state, dict):
        for key, value in state.items():
            out.update(_tensors(value, f"{prefix}/{key}"))
    return out


def _changed_bytes(before: Any, after: Any) -> int:
    old, new = _tensors(before), _tensors(after)
    assert old.keys() == new.keys()
    return sum(t.numel() * t.element_size() for k, t in new.items() if not torch.equal(old[k], t))


def _same(expected: Any, actual: Any) -> None:
    want, got = _tensors(expected), _tensors(actual)
    assert want.keys() == got.keys()
    for key, tensor in want.items():
        assert torch.equal(tensor, got[key]), key


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[dict[str, Any]]]:
    base = tmp_path_factory.mktemp("lora2")
    root, out = base / "root", base / "save"
    return root, out, job("save", root, out, 2)


def test_the_second_save_writes_only_what_changed(
    saved: tuple[Path, Path, list[dict[str, Any]]],
) -> None:
    _, out, reports = saved
    states = torch.load(out / "states.pt")
    base = sum(
        t.numel() * t.element_size()
        for name, t in _tensors(states[1]["model"]).items()
        if name.endswith("base.weight")
    )
    assert base >= 4 * 2**17  # two 256x256 float32 weights: 128 KiB a rank each
    for step in (2, 3):
        save = reports[0]["saves"][str(step)]
        assert all(r["saves"][str(step)] == save for r in reports)  # one checkpoint
        changed = _changed_bytes(states[step - 1], states[step])
        assert changed > 0
        assert save["referenced"] == base  # every base shard, none rewritten
        # the changed tensors, plus trees, headers and the optimizer's step counters
        assert changed <= save["written"] <= changed + 32 * 2**10, (changed, save)
    first = reports[0]["saves"]["1"]
    assert first["referenced"] == 0
    assert first["written"] >= base


def test_every_step_restores_bit_for_bit(
    saved: tuple[Path, Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    root, out, _ = saved
    states = torch.load(out / "states.pt")
    assert [i.step for i in checkpointd.list_checkpoints(str(root))] == [2, 3]  # keep_last=2
    for step in (2, 3):
        loaded = checkpointd.load(str(root), step=step).state
        _same(states[step]["model"], loaded["model"])
        _same(states[step]["optimizer"], loaded["optimizer"]["state"])
        manifest = catalog.read_manifest(open_store(str(root)), step)
        assert manifest.schema_version == 3
        assert verify_step(open_store(str(root)), step, manifest) == []
    restored = tmp_path / "restore"
    job("restore", root, restored, 2, CHECKPOINTD_TEST_STEP="2")
    _same(states[2], torch.load(restored / "restored.pt"))


def test_retention_and_gc_keep_the_blobs_a_manifest_uses(
    saved: tuple[Path, Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    root = tmp_path / "root"
    shutil.copytree(saved[0], root)
    blobs = {int(step): set(s["blobs"]) for step, s in saved[2][0]["saves"].items()}
    store = open_store(str(root))

    def used() -> set[str]:
        return {b.name for _, m in catalog.committed(store) for b in m.blobs}

    # keep_last=2 dropped step 1 and the blobs only it used (its adapters' shards),
    # and kept the base's, which steps 2 and 3 reference
    only_1 = blobs[1] - blobs[2] - blobs[3]
    assert only_1
    assert blobs[1] & blobs[2] & blobs[3]
    assert set(store.list_dir(BLOBS_DIR)) == used() == blobs[2] | blobs[3]
    apply_gc(store, plan_gc(store, RetentionPolicy(keep_last=1), older_than=0.0))
    assert [s for s, _ in catalog.committed(store)] == [3]
    assert set(store.list_dir(BLOBS_DIR)) == used() == blobs[3]
    states = torch.load(saved[1] / "states.pt")
    _same(states[3]["model"], checkpointd.load(str(root), step=3).state["model"])


def test_a_rank_that_fails_before_its_commit_fails_the_save_on_every_rank_at_once(
    tmp_path: Path,
) -> None:
    """Rank 1 cannot write its pin: it abandons the attempt, so rank 0 fails at once
    (not after JOIN_SECONDS waiting for its digest) and nothing is published."""
    root = tmp_path / "root"
    reports = job("pin-fails", root, tmp_path / "out", 2)
    assert reports[1]["save_error"][0] == "StorageError"
    assert reports[0]["save_error"][0] == "RankFailedError"
    assert "rank 1: StorageError" in reports[0]["save_error"][1]
    assert reports[0]["seconds"] < tunables.JOIN_SECONDS / 4
    assert checkpointd.list_checkpoints(str(root)) == []
