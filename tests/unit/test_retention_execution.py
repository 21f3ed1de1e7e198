"""retention.py executes as well as decides: delete_checkpoint (manifest first) and
apply_retention, the public home of what the CLI's gc and the writer use."""

from __future__ import annotations

import warnings
from pathlib import Path

import anyio
import pytest
import torch

import checkpointd
from checkpointd.errors import StorageError
from checkpointd.maintain import retention
from checkpointd.storage import LocalStore


def _commit(root: Path, *steps: int) -> None:
    with checkpointd.CheckpointWriter(str(root)) as writer:
        for step in steps:
            writer.save(step, {"m": torch.full((4,), float(step))}).result(timeout=60)


def _steps(root: Path) -> list[int]:
    return [c.step for c in checkpointd.list_checkpoints(str(root))]


def test_delete_checkpoint_removes_one_step(tmp_path: Path) -> None:
    _commit(tmp_path, 1, 2)
    assert retention.delete_checkpoint(LocalStore(str(tmp_path)), 1)
    assert _steps(tmp_path) == [2]
    assert not (tmp_path / "000000000001").exists()
    assert not retention.delete_checkpoint(LocalStore(str(tmp_path)), 1)


def test_delete_checkpoint_leaves_a_folder_without_manifest_alone(tmp_path: Path) -> None:
    # A save in flight (or a crashed one): only gc removes it, once it is old.
    # Before: the private commit._delete_checkpoint removed the folder regardless.
    _commit(tmp_path, 2)
    in_flight = tmp_path / "000000000003"
    in_flight.mkdir()
    (in_flight / "m.abcd0123.safetensors").write_bytes(b"partial")
    assert not retention.delete_checkpoint(LocalStore(str(tmp_path)), 3)
    assert (in_flight / "m.abcd0123.safetensors").read_bytes() == b"partial"


def test_delete_checkpoint_removes_the_manifest_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _commit(tmp_path, 1, 2)

    def fail(self: LocalStore, path: str) -> None:
        raise StorageError(5, f"injected failure removing {path}")

    monkeypatch.setattr(LocalStore, "remove_dir", fail)
    with pytest.raises(StorageError, match="injected"):
        retention.delete_checkpoint(LocalStore(str(tmp_path)), 1)
    # The files are still there, but without a manifest the step is no checkpoint.
    assert (tmp_path / "000000000001").is_dir()
    assert _steps(tmp_path) == [2]


def test_apply_retention_deletes_what_the_policy_drops(tmp_path: Path) -> None:
    _commit(tmp_path, 1, 2, 3, 4)
    policy = retention.RetentionPolicy(keep_last=1, keep_every=2)

    async def main() -> list[int]:
        limiter = anyio.CapacityLimiter(2)
        return await retention.apply_retention(
            LocalStore(str(tmp_path)), policy, limiter, committed_step=4
        )

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert anyio.run(main) == [1, 3]
    assert _steps(tmp_path) == [2, 4]
