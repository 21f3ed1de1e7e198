"""The writer service: handles, errors that are never lost, back-pressure, both front ends."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import checkpointd
from checkpointd import (
    CheckpointExistsError,
    CheckpointWriter,
    StorageError,
    UnsupportedValueError,
    WriterClosedError,
)
from checkpointd.write.capture import BufferPool
from tests.support.files import component_file
from tests.support.gates import OnLoop


def _state(value: float = 1.0) -> dict[str, object]:
    return {"model": {"w": torch.full((32, 32), value), "b": torch.zeros(32)}}


def test_save_returns_handle_that_resolves_to_info(tmp_path: Path) -> None:
    with CheckpointWriter(str(tmp_path)) as writer:
        handle = writer.save(
            3, _state(), metrics={"loss": torch.tensor(0.5)}, metadata={"run": "a"}
        )
        info = handle.result(timeout=30)
        assert handle.done()
        assert handle.durable_seconds is not None
        assert 0 < handle.blocked_seconds <= handle.durable_seconds
    assert info.step == 3
    assert info.metrics == {"loss": 0.5}
    assert info.metadata == {"run": "a"}
    assert info.components == ("model",)
    assert info.nbytes == sum(
        f.stat().st_size for f in (tmp_path / "000000000003").iterdir() if f.name != "manifest.json"
    )


def test_max_pending_one_means_save_waits_for_the_previous_write(tmp_path: Path) -> None:
    pool = BufferPool()
    with CheckpointWriter(str(tmp_path), max_pending=1, buffer_pool=pool) as writer:
        writer.save(1, _state(1.0))
        writer.save(2, _state(2.0))
        # save(2) could only take the one staging buffer after step 1 was written.
        assert (tmp_path / "000000000001" / "manifest.json").exists()
        writer.wait()
    assert len(pool) == 1  # the writer's one buffer, given back at close
    assert [c.step for c in checkpointd.list_checkpoints(str(tmp_path))] == [1, 2]
    assert checkpointd.load(str(tmp_path), 2).state["model"]["w"][0, 0].item() == 2.0


def _broken_writer(tmp_path: Path) -> CheckpointWriter:
    """A writer whose root becomes a regular file once it has started: creating the step
    folder fails with ENOTDIR in the background (a root that is a file at start is
    refused by the constructor)."""
    root = tmp_path / "root"
    writer = CheckpointWriter(str(root))
    root.write_bytes(b"x")
    return writer


def test_failure_is_raised_by_result_and_then_not_again_by_wait(tmp_path: Path) -> None:
    with _broken_writer(tmp_path) as writer:
        handle = writer.save(1, _state())
        with pytest.raises(StorageError):
            handle.result(timeout=30)
        with pytest.raises(StorageError):
            handle.result(timeout=30)  # the handle keeps its outcome
        writer.wait()  # already seen through the handle


def test_unseen_failure_is_raised_by_wait(tmp_path: Path) -> None:
    with _broken_writer(tmp_path) as writer:
        writer.save(1, _state())
        with pytest.raises(StorageError, match="create folder"):
            writer.wait()
        writer.wait()  # seen now


def test_unseen_failure_is_raised_by_the_next_save(tmp_path: Path) -> None:
    with _broken_writer(tmp_path) as writer:
        first = writer.save(1, _state())
        assert isinstance(first.exception(timeout=60), StorageError)  # still unseen
        with pytest.raises(StorageError):
            writer.save(2, _state())
        writer.wait()


def test_unseen_failure_is_raised_at_close(tmp_path: Path) -> None:
    writer = _broken_writer(tmp_path)
    writer.save(1, _state())
    with pytest.raises(StorageError):
        writer.close()
    with pytest.raises(WriterClosedError):
        writer.save(2, _state())


def test_body_exception_is_not_masked_by_a_background_failure(tmp_path: Path) -> None:
    def train() -> None:
        with _broken_writer(tmp_path) as writer:
            writer.save(1, _state())
            raise KeyError("from the training loop")

    with pytest.raises(KeyError, match="training loop"):
        train()


def test_writer_keeps_working_after_a_failed_save(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with CheckpointWriter(str(root)) as writer:
        writer.save(1, _state(1.0)).result(timeout=30)
        with pytest.raises(CheckpointExistsError):
            writer.save(1, _state(5.0)).result(timeout=30)
        writer.save(2, _state(2.0)).result(timeout=30)
    assert checkpointd.load(str(root), 1).state["model"]["w"][0, 0].item() == 1.0
    assert sorted(os.listdir(root / "000000000001")) == sorted(
        [
            "manifest.json",
            component_file(str(root), 1, "model"),
            component_file(str(root), 1, "model", "tree"),
        ]
    )


@pytest.mark.parametrize("step", [-1, 1.5, True, "3", 10**12])
def test_bad_steps_are_refused_at_save(tmp_path: Path, step: object) -> None:
    with CheckpointWriter(str(tmp_path)) as writer, pytest.raises(ValueError, match="step"):
        writer.save(step, _state())  # type: ignore[arg-type]


def test_unstorable_state_fails_at_save_and_the_writer_goes_on(tmp_path: Path) -> None:
    with CheckpointWriter(str(tmp_path)) as writer:
        with pytest.raises(UnsupportedValueError, match="model/w"):
            writer.save(1, {"model": {"w": torch.zeros(2, dtype=torch.complex128)}})
        with pytest.raises(UnsupportedValueError, match="metrics"):
            writer.save(1, _state(), metrics={"loss": object()})
        info = writer.save(1, _state(), metrics={"loss": float("nan")}).result(timeout=30)
    assert info.metrics == {"loss": None}  # JSON has no NaN: a diverged loss is recorded as null


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_bad_writer_options_are_refused(tmp_path: Path, value: object) -> None:
    with pytest.raises(ValueError, match="max_pending"):
        CheckpointWriter(str(tmp_path), max_pending=value)  # type: ignore[arg-type]


def test_every_training_dtype_round_trips_bit_exact(tmp_path: Path) -> None:
    torch.manual_seed(0)
    base = torch.randn(97)
    base[3] = float("nan")
    base[4] = float("-inf")
    tensors = {
        str(dtype).removeprefix("torch."): base.to(dtype)
        for dtype in (
            torch.float32,
            torch.float16,
            torch.bfloat16,
            torch.float64,
            torch.float8_e4m3fn,
            torch.float8_e5m2,
        )
    }
    ints = torch.randint(-128, 127, (33,))
    for dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        tensors[str(dtype).removeprefix("torch.")] = ints.to(dtype)
    tensors["bool"] = ints > 0
    tensors["scalar"] = torch.tensor(7.25)
    with CheckpointWriter(str(tmp_path)) as writer:
        writer.save(1, {"t": tensors}).result(timeout=30)
    loaded = checkpointd.load(str(tmp_path)).state["t"]
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert loaded[name].shape == tensor.shape, name
        assert torch.equal(
            loaded[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)
        ), name


def test_files_are_readable_by_safetensors(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors")
    state = {"model": {"a.weight": torch.randn(3, 5), "b": torch.arange(4)}}
    with CheckpointWriter(str(tmp_path)) as writer:
        writer.save(1, state).result(timeout=30)
    path = tmp_path / "000000000001" / component_file(str(tmp_path), 1, "model")
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == {"a.weight", "b"}
        assert torch.equal(f.get_tensor("a.weight"), state["model"]["a.weight"])


def test_tied_weights_load_back_tied(tmp_path: Path) -> None:
    embed = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = embed.weight
    model = torch.nn.ModuleDict({"embed": embed, "head": head})
    with CheckpointWriter(str(tmp_path)) as writer:
        writer.save(1, {"model": model}).result(timeout=30)
    state = checkpointd.load(str(tmp_path)).state["model"]
    assert state["embed.weight"] is state["head.weight"]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_async_writer(tmp_path: Path, backend: str) -> None:
    import anyio

    async def main() -> None:
        async with checkpointd.AsyncCheckpointWriter(str(tmp_path), keep_last=2) as writer:
            handles = [await writer.save(step, _state(float(step))) for step in (1, 2, 3)]
            info = await handles[-1].wait()
            assert info.step == 3
            await writer.wait()

    anyio.run(main, backend=backend)
    assert [c.step for c in checkpointd.list_checkpoints(str(tmp_path))] == [2, 3]


def test_async_writer_surfaces_failures(tmp_path: Path) -> None:
    import anyio

    async def main() -> None:
        async with checkpointd.AsyncCheckpointWriter(str(tmp_path / "root")) as writer:
            (tmp_path / "root").write_bytes(b"x")
            handle = await writer.save(1, _state())
            with pytest.raises(StorageError):
                await handle.wait()

    anyio.run(main)


def test_async_writer_raises_unseen_failure_on_exit(tmp_path: Path) -> None:
    import anyio

    async def main() -> None:
        async with checkpointd.AsyncCheckpointWriter(str(tmp_path / "root")) as writer:
            (tmp_path / "root").write_bytes(b"x")
            await writer.save(1, _state())

    with pytest.raises(StorageError):
        anyio.run(main)


def _run_script(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=90, check=False
    )


def test_unclosed_writer_finishes_its_saves_at_exit(tmp_path: Path) -> None:
    done = _run_script(
        "import checkpointd, torch\n"
        f"w = checkpointd.CheckpointWriter({str(tmp_path)!r})\n"
        "w.save(1, {'m': {'w': torch.ones(1000)}})\n"
    )
    assert done.returncode == 0, done.stderr
    assert checkpointd.load(str(tmp_path)).state["m"]["w"].sum().item() == 1000


def test_unclosed_writer_reports_an_unseen_failure_at_exit(tmp_path: Path) -> None:
    done = _run_script(
        "import checkpointd, torch\n"
        f"w = checkpointd.CheckpointWriter({str(tmp_path / 'root')!r})\n"
        f"open({str(tmp_path / 'root')!r}, 'wb').close()\n"
        "w.save(1, {'m': {'w': torch.ones(3)}})\n"
    )
    assert "checkpointd: unclosed writer" in done.stderr
    assert "Not a directory" in done.stderr


def test_load_components_subset_and_map_location(tmp_path: Path) -> None:
    shared = torch.randn(8, 8)
    state = {"a": {"x": shared, "y": shared}, "b": {"z": torch.ones(2)}}
    with CheckpointWriter(str(tmp_path)) as writer:
        writer.save(5, state).result(timeout=30)
    loaded = checkpointd.load(str(tmp_path), components=["a"], map_location="cpu")
    assert list(loaded.state) == ["a"]
    assert loaded.state["a"]["x"] is loaded.state["a"]["y"]  # still tied after the move
    assert torch.equal(loaded.state["a"]["x"], shared)
    with pytest.raises(checkpointd.CheckpointNotFoundError, match="no component 'c'"):
        checkpointd.load(str(tmp_path), components=["c"])
    with pytest.raises(checkpointd.CheckpointNotFoundError, match="step 6"):
        checkpointd.load(str(tmp_path), 6)
    with pytest.raises(checkpointd.CheckpointNotFoundError, match="no committed checkpoint"):
        checkpointd.load(str(tmp_path / "empty"))


def _thread_niceness() -> dict[int, int]:
    """Niceness of every thread of this process, from /proc (field 19 of stat)."""
    result = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        result[int(tid)] = int(fields[16])
    return result


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux")
def test_background_niceness_lowers_only_the_writers_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import anyio.to_thread

    on_loop = OnLoop(monkeypatch)
    on_loop.queued += [
        threading.get_native_id,
        lambda: anyio.to_thread.run_sync(threading.get_native_id),
    ]
    with CheckpointWriter(str(tmp_path), background_niceness=7) as writer:
        writer.save(1, _state()).result(timeout=30)
        loop_thread, worker_thread = on_loop.outcomes
        niceness = _thread_niceness()
    assert niceness[loop_thread] == 7
    assert niceness[worker_thread] == 7  # spawned by the loop thread, so it inherits
    assert niceness[threading.get_native_id()] == 0  # the caller keeps its priority


@pytest.mark.parametrize("value", [-1, 20, True, 1.5])
def test_bad_background_niceness_is_refused(tmp_path: Path, value: object) -> None:
    with pytest.raises(ValueError, match="background_niceness"):
        CheckpointWriter(str(tmp_path), background_niceness=value)  # type: ignore[arg-type]
