"""Overlapped staging (``staging="overlapped"``): what is copied when, and what waits for it.

The background copy is held at a gate (``staging.copy_in_background``), so each
test sees the window between ``save()`` returning and the copy ending for certain.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import checkpointd
from checkpointd.errors import (
    CheckpointTimeoutError,
    InvalidArgumentError,
    StagingError,
    UnsupportedValueError,
)
from checkpointd.write import staging as staging_module
from tests.support.torch_private import cuda_sleep, step_pre_hooks


class Gate:
    """Holds every background copy until ``open()``; counts the copies that started."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened = threading.Event()
        self.started = threading.Event()
        real = staging_module.copy_in_background

        def held(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
            self.started.set()
            if not self.opened.wait(60):
                raise TimeoutError("the test never opened the gate")
            real(copies)

        monkeypatch.setattr(staging_module, "copy_in_background", held)

    def open(self) -> None:
        self.opened.set()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    held = Gate(monkeypatch)
    yield held
    held.open()  # never leave a copier thread waiting


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def test_overlapped_save_stores_what_blocking_stores(tmp_path: Path) -> None:
    model, optimizer = _trained()
    state = {"model": model, "optimizer": optimizer, "extra": {"t": torch.arange(5)}}
    with checkpointd.CheckpointWriter(str(tmp_path / "o"), staging="overlapped") as writer:
        assert writer.staging == "overlapped"
        writer.save(1, state).result(timeout=60)
    with checkpointd.CheckpointWriter(str(tmp_path / "b")) as writer:
        handle = writer.save(1, state)
        assert handle.staged()  # blocking mode: staged when save() returns
        writer.wait_staged()
        handle.result(timeout=60)
    overlapped = checkpointd.load(str(tmp_path / "o")).state
    blocking = checkpointd.load(str(tmp_path / "b")).state
    for name in state:
        _assert_same(overlapped[name], blocking[name])
    _assert_same(overlapped["model"], _copy(model.state_dict()))


def test_background_copies_are_bit_exact_for_every_float_dtype(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Background copies go through NumPy bytes (bfloat16 and float8 have no NumPy
    dtype); a non-contiguous parameter goes through Tensor.copy_."""
    torch.manual_seed(0)
    dtypes = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]
    params = [torch.nn.Parameter(torch.randn(5, 3).to(dtype)) for dtype in dtypes]
    params.append(torch.nn.Parameter(torch.randn(3, 4).t()))  # non-contiguous
    params.append(torch.nn.Parameter(torch.randn(7).to(torch.float8_e4m3fn), requires_grad=False))
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for p in params[:-1]:
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert not params[5].is_contiguous()
    state = {"params": {str(i): p for i, p in enumerate(params)}, "optimizer": optimizer}
    expected = _copy({str(i): p.detach() for i, p in enumerate(params)})
    moments = _copy(optimizer.state_dict()["state"])
    copied: list[torch.dtype] = []
    real = staging_module.copy_in_background

    def recording(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        copied.extend(source.dtype for source, _ in copies)
        real(copies)

    monkeypatch.setattr(staging_module, "copy_in_background", recording)
    with checkpointd.CheckpointWriter(str(tmp_path), staging="overlapped") as writer:
        writer.save(1, state).result(timeout=60)
    assert len(copied) == 7 + 6  # every parameter and momentum buffer, in the background
    loaded = checkpointd.load(str(tmp_path)).state
    for name, tensor in expected.items():
        stored = loaded["params"][name]
        assert stored.dtype == tensor.dtype
        assert torch.equal(stored.view(torch.uint8), tensor.contiguous().view(torch.uint8))
    _assert_same(loaded["optimizer"]["state"], moments)


def test_bad_staging_option_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="staging"):
        checkpointd.CheckpointWriter(str(tmp_path), staging="lazy")  # type: ignore[arg-type]


def test_only_optimized_tensors_stage_after_save_returns(tmp_path: Path, gate: Gate) -> None:
    """Buffers, parameters no optimizer in the state owns and user tensors are copied
    before save() returns: changing them right after does not reach the checkpoint."""
    model, optimizer = _trained()
    frozen = torch.nn.Linear(4, 4)
    user = {"ema": torch.ones(6)}
    state = {"model": model, "optimizer": optimizer, "frozen": frozen, "user": user}
    expected = {"model": _copy(model.state_dict()), "frozen": _copy(frozen.state_dict())}
    with checkpointd.CheckpointWriter(str(tmp_path), staging="overlapped") as writer:
        handle = writer.save(1, state)
        assert gate.started.wait(30)
        assert not handle.staged()
        with torch.no_grad():
            model[1].running_mean.add_(100.0)  # what a forward pass in train mode does
            frozen.weight.add_(100.0)
            user["ema"].mul_(3.0)
        gate.open()
        handle.wait_staged(timeout=60)
        assert handle.staged()
        handle.result(timeout=60)
    loaded = checkpointd.load(str(tmp_path)).state
    _assert_same(loaded["model"], expected["model"])
    _assert_same(loaded["frozen"], expected["frozen"])
    assert torch.equal(loaded["user"]["ema"], torch.ones(6))


def test_an_unstorable_value_fails_save_at_once_and_the_writer_goes_on(tmp_path: Path) -> None:
    model, optimizer = _trained()
    with checkpointd.CheckpointWriter(str(tmp_path), staging="overlapped") as writer:
        bad = {"model": model, "optimizer": optimizer, "x": object()}
        refused: list[Exception] = []

        def save_bad() -> None:
            try:
                writer.save(1, bad)
            except UnsupportedValueError as exc:
                refused.append(exc)

        saver = threading.Thread(target=save_bad)
        saver.start()
        saver.join(30)
        assert not saver.is_alive(), "save() hung after refusing a value"
        assert refused
        assert writer.save(2, {"model": model, "optimizer": optimizer}).result(timeout=60).step == 2


def test_optimizers_nested_in_a_component_are_guarded() -> None:
    model, optimizer = _trained()
    stager = staging_module.Stager()
    guarded = stager.guard({"model": model, "train": {"loop": [optimizer]}})
    expected = {staging_module.tensor_key(p) for p in model.parameters()}
    assert expected <= guarded
    assert len(step_pre_hooks(optimizer)) == 1
    stager.guard({"train": {"loop": [optimizer]}})  # hooked once per writer
    assert len(step_pre_hooks(optimizer)) == 1
    stager.close()
    assert step_pre_hooks(optimizer) == {}


def test_optimizer_step_waits_for_staging(tmp_path: Path, gate: Gate) -> None:
    model, optimizer = _trained()
    expected = _copy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    with checkpointd.CheckpointWriter(str(tmp_path), staging="overlapped") as writer:
        handle = writer.save(1, {"model": model, "optimizer": optimizer})
        assert gate.started.wait(30)
        stepped = threading.Event()

        def step() -> None:
            model(torch.randn(4, 8)).sum().backward()  # forward and backward overlap the copy
            optimizer.step()
            stepped.set()

        stepper = threading.Thread(target=step)
        stepper.start()
        held = not stepped.wait(0.5)
        gate.open()
        stepper.join(60)
        assert held, "optimizer.step() ran while its parameters were being copied"
        assert stepped.is_set()
        handle.result(timeout=60)
    loaded = checkpointd.load(str(tmp_path)).state
    _assert_same(loaded["model"], expected["model"])
    _assert_same(loaded["optimizer"]["state"], expected["optimizer"]["state"])
    assert step_pre_hooks(optimizer) == {}, "close() removes the step pre-hooks"


def test_next_save_waits_for_the_previous_staging(tmp_path: Path, gate: Gate) -> None:
    model, optimizer = _trained()
    state = {"model": model, "optimizer": optimizer}
    with checkpointd.CheckpointWriter(str(tmp_path), staging="overlapped", max_pending=2) as writer:
        first = writer.save(1, state)
        assert gate.started.wait(30)
        second: list[checkpointd.SaveHandle] = []
        saver = threading.Thread(target=lambda: second.append(writer.save(2, state)))
        saver.start()
        saver.join(0.5)
        waited = saver.is_alive()
        gate.open()
        saver.join(60)
        assert waited, "a second save started while the first was still staging"
        assert first.result(timeout=60).step == 1
        assert second[0].result(timeout=60).step == 2


def test_wait_staged_times_out_while_the_copy_is_held(tmp_path: Path, gate: Gate) -> None:
    model, optimizer = _trained()
    with checkpointd.CheckpointWriter(str(tmp_path), staging="overlapped") as writer:
        handle = writer.save(1, {"model": model, "optimizer": optimizer})
        with pytest.raises(CheckpointTimeoutError):
            writer.wait_staged(timeout=0.05)
        with pytest.raises(CheckpointTimeoutError):
            handle.wait_staged(timeout=0.05)
        assert not handle.done()  # the write waits for the copy
        gate.open()
        writer.wait_staged(timeout=60)
        handle.result(timeout=60)


def test_a_failed_background_copy_fails_the_handle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(staging_module, "copy_in_background", broken)
    model, optimizer = _trained()
    state = {"model": model, "optimizer": optimizer}
    with checkpointd.CheckpointWriter(str(tmp_path), staging="overlapped") as writer:
        handle = writer.save(1, state)
        with pytest.raises(StagingError, match="device lost") as caught:
            handle.result(timeout=60)
        assert isinstance(caught.value.__cause__, RuntimeError)
        assert handle.staged()
        writer.wait()  # seen through the handle: not raised again
        assert checkpointd.list_checkpoints(str(tmp_path)) == []
        monkeypatch.undo()
        assert writer.save(2, state).result(timeout=60).step == 2  # the writer goes on


def test_an_unseen_staging_failure_is_raised_by_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(staging_module, "copy_in_background", broken)
    model, optimizer = _trained()
    writer = checkpointd.CheckpointWriter(str(tmp_path), staging="overlapped")
    try:
        writer.save(1, {"model": model, "optimizer": optimizer})
        with pytest.raises(StagingError):
            writer.wait()
    finally:
        writer.close()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_async_writer_overlapped(tmp_path: Path, backend: str, gate: Gate) -> None:
    model, optimizer = _trained()
    expected = _copy(model.state_dict())

    async def main() -> None:
        async with checkpointd.AsyncCheckpointWriter(str(tmp_path), staging="overlapped") as writer:
            handle = await writer.save(1, {"model": model, "optimizer": optimizer})
            assert not handle.staged()
            with pytest.raises(CheckpointTimeoutError):
                await writer.wait_staged(timeout=0.05)
            gate.open()
            await writer.wait_staged()
            assert (await handle.wait()).step == 1
        assert step_pre_hooks(optimizer) == {}

    anyio.run(main, backend=backend)
    _assert_same(checkpointd.load(str(tmp_path)).state["model"], expected)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@needs_cuda
def test_cuda_overlapped_copies_see_kernels_queued_before_save(tmp_path: Path) -> None:
    """The side stream waits for the work queued before save(); the step waits for it."""
    device = torch.device("cuda")
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(16, 256, device=device)).sum().backward()
    optimizer.step()
    with checkpointd.CheckpointWriter(str(tmp_path), staging="overlapped") as writer:
        cuda_sleep(50_000_000)  # the fills below run well after save() returns
        with torch.no_grad():
            model[0].weight.fill_(7.0)
            model[1].running_mean.fill_(3.0)
        handle = writer.save(1, {"model": model, "optimizer": optimizer})
        with torch.no_grad():
            model[1].running_mean.fill_(-1.0)  # after save(): not in the checkpoint
        model(torch.randn(16, 256, device=device)).sum().backward()
        optimizer.step()  # waits for the copy of weights and moments
        handle.result(timeout=60)
    loaded = checkpointd.load(str(tmp_path)).state
    assert torch.equal(loaded["model"]["0.weight"], torch.full((256, 256), 7.0))
    assert torch.equal(loaded["model"]["1.running_mean"], torch.full((256,), 3.0))
    assert not torch.equal(model[0].weight.cpu(), loaded["model"]["0.weight"])
