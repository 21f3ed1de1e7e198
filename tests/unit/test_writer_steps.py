"""Errors at save() or construction instead of later: bad roots, step order, oversized
metadata; and the writer reading its own root (list, load, restore)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import checkpointd
from checkpointd import CheckpointExistsError, CheckpointWriter, StorageError, tunables
from checkpointd.maintain.retention import WriterIdentity
from checkpointd.storage import LocalStore
from tests.conftest import Root
from tests.support.gates import hold_local_writes


def _state(value: float = 1.0) -> dict[str, Any]:
    return {"model": {"w": torch.full((16,), value)}}


def _steps(root: Path) -> list[int]:
    return [c.step for c in checkpointd.list_checkpoints(str(root))]


def _commit(root: Path, *steps: int) -> None:
    with CheckpointWriter(str(root)) as writer:
        for step in steps:
            writer.save(step, _state(float(step))).result(timeout=60)


# --- the root ---------------------------------------------------------------------------


def test_a_root_that_is_a_file_is_refused_at_construction(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.write_bytes(b"not a folder")
    with pytest.raises(StorageError, match="is a file, not a folder"):
        CheckpointWriter(str(root))
    with pytest.raises(StorageError, match="is a file, not a folder"):
        checkpointd.AsyncCheckpointWriter(str(root))


def test_a_root_below_a_file_is_refused_at_construction(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(StorageError, match="Not a directory"):
        CheckpointWriter(str(tmp_path / "file" / "ckpt"))


# --- step order ---------------------------------------------------------------------------


def test_a_step_older_than_the_newest_committed_is_refused_by_default(tmp_path: Path) -> None:
    _commit(tmp_path, 100, 300)
    with CheckpointWriter(str(tmp_path)) as writer:
        with pytest.raises(checkpointd.CheckpointError, match="newest committed") as error:
            writer.save(200, _state())
        assert error.type.__name__ == "StepOrderError"
        assert "step 300" in str(error.value)
        assert "newer_steps='discard'" in str(error.value)
        with pytest.raises(CheckpointExistsError, match="already committed"):
            writer.save(300, _state())
        writer.save(301, _state()).result(timeout=60)
    assert _steps(tmp_path) == [100, 300, 301]


def test_the_writer_tracks_its_own_commits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    listings = 0
    real_list_dir = LocalStore.list_dir

    def list_dir(self: LocalStore, path: str) -> list[str]:
        nonlocal listings
        listings += path == ""  # the root; a commit may list its own step folder
        return real_list_dir(self, path)

    monkeypatch.setattr(LocalStore, "list_dir", list_dir)
    with CheckpointWriter(str(tmp_path)) as writer:
        assert listings == 1  # the newest committed step is read once, at construction
        writer.save(5, _state()).result(timeout=60)
        with pytest.raises(checkpointd.StepOrderError, match="step 5"):
            writer.save(4, _state())
        writer.save(6, _state()).result(timeout=60)
        assert listings == 1  # no listing per save


def test_a_step_older_than_a_save_in_flight_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = hold_local_writes(monkeypatch)
    with CheckpointWriter(str(tmp_path), max_pending=2) as writer:
        writer.save(10, _state())
        with pytest.raises(checkpointd.StepOrderError, match="being saved"):
            writer.save(9, _state())
        gate.set()


def test_newer_steps_keep_saves_an_older_step_and_keeps_the_newer(tmp_path: Path) -> None:
    _commit(tmp_path, 100, 300)
    with CheckpointWriter(str(tmp_path), newer_steps="keep") as writer:
        writer.save(200, _state()).result(timeout=60)
        with pytest.raises(CheckpointExistsError):
            writer.save(300, _state())
    assert _steps(tmp_path) == [100, 200, 300]


def test_newer_steps_discard_deletes_newer_steps_after_the_commit_before_retention(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _commit(tmp_path, 100, 300, 400)
    # 100 comes from another writer: without this, the grace window would keep it. The
    # window is also twice this writer's save interval, which on a loaded machine can
    # exceed 100's age: no window at all, so the test checks the discard alone.
    monkeypatch.setattr(WriterIdentity, "grace", lambda self: 0.0)
    in_flight = tmp_path / "000000000500"  # another save's folder, no manifest yet
    in_flight.mkdir()
    (in_flight / "model.safetensors").write_bytes(b"partial")
    with CheckpointWriter(str(tmp_path), newer_steps="discard", keep_last=2) as writer:
        info = writer.save(200, _state(2.0)).result(timeout=60)
        assert info.step == 200
        # Retention ran after the discard: keep_last=2 kept 100 and 200, not 300 and 400.
        assert _steps(tmp_path) == [100, 200]
        writer.save(201, _state()).result(timeout=60)  # 200 is now the newest
    assert _steps(tmp_path) == [200, 201]
    assert not (tmp_path / "000000000300").exists()
    assert (in_flight / "model.safetensors").exists()  # uncommitted: left for gc


def test_a_refused_save_does_not_discard(tmp_path: Path) -> None:
    _commit(tmp_path, 100, 300)
    with (
        CheckpointWriter(str(tmp_path), newer_steps="discard") as writer,
        pytest.raises(checkpointd.UnsupportedValueError),
    ):
        writer.save(200, {"bad": {"x": object()}})
    assert _steps(tmp_path) == [100, 300]


@pytest.mark.parametrize("value", ["drop", None, 1])
def test_bad_newer_steps_is_refused(tmp_path: Path, value: object) -> None:
    with pytest.raises(ValueError, match="newer_steps"):
        CheckpointWriter(str(tmp_path), newer_steps=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_async_writer_refuses_an_older_step(tmp_path: Path, backend: str) -> None:
    _commit(tmp_path, 100, 300)

    async def main() -> None:
        async with checkpointd.AsyncCheckpointWriter(str(tmp_path)) as writer:
            with pytest.raises(checkpointd.StepOrderError, match="step 300"):
                await writer.save(200, _state())
        async with checkpointd.AsyncCheckpointWriter(
            str(tmp_path), newer_steps="discard"
        ) as writer:
            await (await writer.save(200, _state())).wait()

    anyio.run(main, backend=backend)
    assert _steps(tmp_path) == [100, 200]


# --- metrics and metadata size -------------------------------------------------------------


class _Counting:
    """A Stateful that counts state_dict() calls (each one a capture)."""

    def __init__(self) -> None:
        self.calls = 0

    def state_dict(self) -> dict[str, Any]:
        self.calls += 1
        return {"w": torch.ones(4)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_metadata_too_large_for_a_manifest_is_refused_before_capture(tmp_path: Path) -> None:
    counting = _Counting()
    huge = {"blob": "x" * (tunables.MAX_MANIFEST_BYTES + 1)}
    with CheckpointWriter(str(tmp_path)) as writer:
        with pytest.raises(checkpointd.UnsupportedValueError, match="fit in a manifest"):
            writer.save(1, {"c": counting}, metadata=huge)
        with pytest.raises(checkpointd.UnsupportedValueError, match="fit in a manifest"):
            writer.save(1, {"c": counting}, metrics={"a": "y" * (tunables.MAX_MANIFEST_BYTES // 4)})
        assert counting.calls == 0
        # Under the limit it is stored, and every reader accepts the manifest.
        writer.save(1, {"c": counting}, metadata={"blob": "x" * 2**20}).result(timeout=60)
    assert checkpointd.load(str(tmp_path)).info.metadata["blob"] == "x" * 2**20
    assert not (tmp_path / "000000000002").exists()


# --- the writer reads its own root --------------------------------------------------------


def test_writer_lists_loads_and_restores_its_root_with_its_storage_options(
    s3_root: Root,
) -> None:
    model = torch.nn.Linear(3, 2)
    with CheckpointWriter(s3_root.url, storage_options=s3_root.storage_options) as writer:
        assert writer.list_checkpoints() == []
        writer.save(1, {"model": model}).result(timeout=60)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            model.weight.zero_()
        assert [c.step for c in writer.list_checkpoints()] == [1]
        loaded = writer.load(components=["model"])
        assert loaded.info.step == 1
        assert torch.equal(loaded.state["model"]["weight"], saved["weight"])
        info = writer.restore({"model": model}, step=1)
        assert info.restored == ("model",)
    assert torch.equal(model.weight, saved["weight"])


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_async_writer_lists_loads_and_restores_its_root(tmp_path: Path, backend: str) -> None:
    model = torch.nn.Linear(3, 2)
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    async def main() -> None:
        async with checkpointd.AsyncCheckpointWriter(str(tmp_path)) as writer:
            await (await writer.save(7, {"model": model})).wait()
            with torch.no_grad():
                model.weight.zero_()
            assert [c.step for c in await writer.list_checkpoints()] == [7]
            loaded = await writer.load(7)
            assert torch.equal(loaded.state["model"]["weight"], saved["weight"])
            await writer.restore({"model": model}, strict=True)

    anyio.run(main, backend=backend)
    assert torch.equal(model.weight, saved["weight"])


@pytest.mark.parametrize("depth", [101, 5000])
def test_metadata_nested_deeper_than_readers_accept_is_refused_at_save(
    tmp_path: Path, depth: int
) -> None:
    nested: Any = 1
    for _ in range(depth):
        nested = [nested]
    with checkpointd.CheckpointWriter(str(tmp_path / "ckpt")) as writer:
        with pytest.raises(checkpointd.UnsupportedValueError, match="deeper than 100"):
            writer.save(1, {"w": torch.zeros(1)}, metadata={"deep": nested})
        writer.save(2, {"w": torch.zeros(1)}).result(timeout=60)
    assert [i.step for i in checkpointd.list_checkpoints(str(tmp_path / "ckpt"))] == [2]
