"""The writer's other modes through a real ``checkpointd serve``: AsyncCheckpointWriter
(asyncio and trio) and ``staging="overlapped"``, each writing the files an
in-process writer writes; a failed background copy, and a trainer killed once its
overlapped save is staged."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import torch

import checkpointd
from checkpointd.daemon.client.client import status
from checkpointd.errors import CheckpointExistsError, InvalidArgumentError, StagingError
from checkpointd.write import staging as staging_module
from checkpointd.write.capture import BufferPool
from tests.support.service import (
    Service,
    files_by_component,
    kill_at_line,
    running_service,
    trainer,
    wait_for,
)


@pytest.fixture
def service() -> Iterator[Service]:
    with running_service() as running:
        yield running


def _trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(8, 16)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_async_writer_through_the_service_writes_what_in_process_writes(
    service: Service, tmp_path: Path, backend: str
) -> None:
    model, optimizer = _trained()
    state = {"model": model, "optimizer": optimizer, "extra": {"epoch": 2}}

    async def save_twice(root: str, socket: str | None) -> list[int]:
        async with checkpointd.AsyncCheckpointWriter(root, service=socket, keep_last=1) as writer:
            first = await writer.save(1, state, metrics={"loss": 0.5})
            second = await writer.save(2, state)  # pending when the writer closes
            steps = [(await first.wait()).step]
        steps.append((await second.wait()).step)  # resolved by aclose's wait
        return steps

    for name, socket in (("inproc", None), ("svc", service.socket)):
        assert anyio.run(save_twice, str(tmp_path / name), socket, backend=backend) == [1, 2]
    assert [c.step for c in checkpointd.list_checkpoints(str(tmp_path / "svc"))] == [2]
    assert files_by_component(tmp_path / "svc", 2) == files_by_component(tmp_path / "inproc", 2)


def test_async_writer_sees_a_failure_in_the_service(service: Service, tmp_path: Path) -> None:
    root = str(tmp_path)

    async def main() -> None:
        async with checkpointd.AsyncCheckpointWriter(root, service=service.socket) as writer:
            await (await writer.save(1, {"t": torch.ones(4)})).wait()
            with checkpointd.CheckpointWriter(root) as other:  # commits step 2 first
                other.save(2, {"t": torch.full((4,), 2.0)}).result(30)
            failing = await writer.save(2, {"t": torch.zeros(4)})
            with pytest.raises(CheckpointExistsError):
                await failing.wait()
            await writer.save(2, {"t": torch.zeros(4)})  # fails too, unseen
            with pytest.raises(CheckpointExistsError):
                await writer.wait()

    anyio.run(main)
    assert torch.equal(checkpointd.load(root).state["t"], torch.full((4,), 2.0))


class _HeldCopies:
    """Holds each overlapped background copy until ``open()``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened = threading.Event()
        real = staging_module.copy_in_background

        def held(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
            if not self.opened.wait(60):
                raise TimeoutError("the test never opened the gate")
            real(copies)

        monkeypatch.setattr(staging_module, "copy_in_background", held)


def test_overlapped_staging_through_the_service(
    service: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = _trained()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    state = {"model": model, "optimizer": optimizer}
    with checkpointd.CheckpointWriter(str(tmp_path / "inproc"), staging="overlapped") as writer:
        writer.save(1, state).result(60)
    held = _HeldCopies(monkeypatch)
    root = str(tmp_path / "svc")
    with checkpointd.CheckpointWriter(root, service=service.socket, staging="overlapped") as writer:
        handle = writer.save(1, state)
        assert not handle.staged()
        time.sleep(0.2)
        assert not handle.done()  # not sent: the copy is held
        assert status(service.socket).saves_in_flight == 0
        held.opened.set()
        model(torch.randn(8, 16)).sum().backward()
        optimizer.step()  # waits for the copy of what it changes (the stager's hook)
        assert handle.result(60).step == 1
        second = writer.save(2, state)  # the next save after an overlapped one
    assert second.result(60).step == 2
    loaded = checkpointd.load(root, 1).state["model"]
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
    assert files_by_component(tmp_path / "svc", 1) == files_by_component(tmp_path / "inproc", 1)


def test_closing_the_writer_waits_for_an_overlapped_copy_to_be_handed_over(
    service: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = _trained()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    held = _HeldCopies(monkeypatch)
    root = str(tmp_path)
    writer = checkpointd.CheckpointWriter(root, service=service.socket, staging="overlapped")
    handle = writer.save(1, {"model": model, "optimizer": optimizer})
    opener = threading.Timer(0.5, held.opened.set)
    opener.start()
    try:
        writer.close()  # while the copy is held: the save is not the service's yet
    finally:
        opener.join()
    assert handle.result(0).step == 1
    loaded = checkpointd.load(root, 1).state["model"]
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_a_failed_overlapped_copy_fails_the_handle_and_frees_the_segment(
    service: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(staging_module, "copy_in_background", broken)
    model, optimizer = _trained()
    state = {"model": model, "optimizer": optimizer}
    root = str(tmp_path)
    with checkpointd.CheckpointWriter(root, service=service.socket, staging="overlapped") as writer:
        handle = writer.save(1, state)
        with pytest.raises(StagingError, match="device lost"):
            handle.result(60)
        wait_for(lambda: status(service.socket).bytes_staged == 0)
        assert checkpointd.list_checkpoints(root) == []
        monkeypatch.undo()
        assert writer.save(2, state).result(60).step == 2  # the writer goes on
    assert [c.step for c in checkpointd.list_checkpoints(root)] == [2]


def test_a_trainer_killed_once_its_overlapped_save_is_staged_still_commits(
    service: Service, tmp_path: Path
) -> None:
    root = str(tmp_path / "root")
    kill_at_line(trainer(service.socket, root, 3, "overlapped"), "staged 1")
    wait_for(lambda: {0, 1} <= {c.step for c in checkpointd.list_checkpoints(root)})
    wait_for(lambda: status(service.socket).saves_in_flight == 0)
    from tests.support.service_jobs import expected_state

    for step in (0, 1):
        loaded = checkpointd.load(root, step).state["model"]
        for name, tensor in expected_state(step).items():
            assert torch.equal(loaded[name], tensor), (step, name)


def test_a_buffer_pool_is_refused_with_the_service(service: Service, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="buffer_pool"):
        checkpointd.CheckpointWriter(
            str(tmp_path), service=service.socket, buffer_pool=BufferPool()
        )
