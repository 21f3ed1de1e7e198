"""The writer's public API additions: retention=RetentionPolicy(...), and every error it raises
for bad arguments or timeouts is a CheckpointError as well as the builtin callers caught before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import checkpointd
from checkpointd import (
    CheckpointError,
    CheckpointTimeoutError,
    CheckpointWriter,
    InvalidArgumentError,
    RetentionPolicy,
)
from tests.support.gates import hold_local_writes


def _state(value: float = 1.0) -> dict[str, Any]:
    return {"model": {"w": torch.full((4,), value)}}


def _steps(root: Path) -> list[int]:
    return [c.step for c in checkpointd.list_checkpoints(str(root))]


def test_retention_policy_object_is_applied(tmp_path: Path) -> None:
    with CheckpointWriter(str(tmp_path), retention=RetentionPolicy(keep_last=2)) as writer:
        assert writer.policy == RetentionPolicy(keep_last=2)
        for step in (1, 2, 3, 4):
            writer.save(step, _state(step)).result(timeout=60)
    assert _steps(tmp_path) == [3, 4]


def test_retention_policy_and_loose_options_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="not both"):
        CheckpointWriter(str(tmp_path), retention=RetentionPolicy(keep_last=2), keep_every=10)
    with pytest.raises(InvalidArgumentError, match="not both"):
        CheckpointWriter(str(tmp_path), retention=RetentionPolicy(), best_mode="max")
    with pytest.raises(InvalidArgumentError, match="RetentionPolicy"):
        CheckpointWriter(str(tmp_path), retention={"keep_last": 2})  # type: ignore[arg-type]
    assert not (tmp_path / "000000000000").exists()


@pytest.mark.parametrize(
    "options",
    [
        {"max_pending": 0},
        {"max_concurrency": True},
        {"background_niceness": 20},
        {"newer_steps": "sometimes"},
        {"keep_last": 0},
        {"keep_best": 2},  # without best_metric
        {"best_mode": "median"},
    ],
)
def test_bad_options_raise_invalid_argument_error(tmp_path: Path, options: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError) as error:
        CheckpointWriter(str(tmp_path), **options)
    assert isinstance(error.value, CheckpointError)
    assert isinstance(error.value, ValueError)  # what callers caught before


@pytest.mark.parametrize("step", [-1, 10**12, 1.0, True, "3"])
def test_bad_step_raises_invalid_argument_error(tmp_path: Path, step: Any) -> None:
    with (
        CheckpointWriter(str(tmp_path)) as writer,
        pytest.raises(InvalidArgumentError, match="step must be an int"),
    ):
        writer.save(step, _state())
    assert _steps(tmp_path) == []


def test_timeouts_raise_checkpoint_timeout_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = hold_local_writes(monkeypatch)
    with CheckpointWriter(str(tmp_path)) as writer:
        handle = writer.save(1, _state())
        try:
            with pytest.raises(CheckpointTimeoutError, match="still running") as error:
                handle.result(timeout=0.05)
            assert isinstance(error.value, TimeoutError)
            with pytest.raises(CheckpointTimeoutError, match="still running"):
                writer.wait(timeout=0.05)
        finally:
            gate.set()
        assert handle.result(timeout=60).step == 1


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_async_wait_timeout_is_a_checkpoint_timeout_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    gate = hold_local_writes(monkeypatch)

    async def main() -> None:
        async with checkpointd.AsyncCheckpointWriter(str(tmp_path)) as writer:
            await writer.save(1, _state())
            with pytest.raises(CheckpointTimeoutError):
                await writer.wait(timeout=0.05)
            gate.set()
            await writer.wait(timeout=60)

    anyio.run(main, backend=backend)
