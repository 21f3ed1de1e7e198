"""The checkpoint service end to end: a real ``checkpointd serve`` process, real sockets
and shared memory; the writer and the CLI as a user runs them."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import checkpointd
from checkpointd.errors import InvalidArgumentError, ServiceError
from tests.support.service import (
    Service,
    files_by_component,
    run_python,
    running_service,
    socket_folder,
)


@pytest.fixture
def service() -> Iterator[Service]:
    with running_service() as running:
        yield running


def _state(seed: int = 0) -> dict[str, object]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 32)).sum().backward()
    optimizer.step()
    return {
        "model": model,
        "optimizer": optimizer,
        "extra": {"epoch": 3, "pair": (1, "x"), "ids": torch.arange(10), "big": 2**70},
    }


def test_files_are_byte_identical_to_an_in_process_save(service: Service, tmp_path: Path) -> None:
    state = _state()
    with checkpointd.CheckpointWriter(str(tmp_path / "inproc")) as writer:
        writer.save(5, state, metrics={"loss": 0.25}, metadata={"run": "a"}).result(30)
    with checkpointd.CheckpointWriter(str(tmp_path / "svc"), service=service.socket) as writer:
        handle = writer.save(5, state, metrics={"loss": 0.25}, metadata={"run": "a"})
        info = handle.result(30)
    assert info.step == 5
    assert info.metrics == {"loss": 0.25}
    assert files_by_component(tmp_path / "svc", 5) == files_by_component(tmp_path / "inproc", 5)
    loaded = checkpointd.load(str(tmp_path / "svc"))
    assert torch.equal(loaded.state["extra"]["ids"], torch.arange(10))
    assert loaded.state["extra"]["pair"] == (1, "x")
    assert loaded.state["extra"]["big"] == 2**70


def test_retention_and_step_order_as_in_process(service: Service, tmp_path: Path) -> None:
    root = str(tmp_path / "r")
    state = _state()
    with checkpointd.CheckpointWriter(root, service=service.socket, keep_last=2) as writer:
        for step in range(4):
            writer.save(step, state)
        writer.wait(60)
        with pytest.raises(checkpointd.StepOrderError):
            writer.save(1, state)
    assert [c.step for c in checkpointd.list_checkpoints(root)] == [2, 3]


def test_status_shows_kept_steps_and_clients(service: Service, tmp_path: Path) -> None:
    root = str(tmp_path / "r")
    with checkpointd.CheckpointWriter(root, service=service.socket) as writer:
        writer.save(1, _state()).result(30)
        shown = run_python(
            "-m", "checkpointd", "status", "--socket", service.socket, "--json", check=True
        )
        status = json.loads(shown.stdout)
    assert status["clients"] == 1
    assert status["saves_in_flight"] == 0
    assert status["bytes_kept"] > 0
    assert status["committed"] == 1
    (kept,) = status["kept"].values()
    assert kept == [1]
    text = run_python("-m", "checkpointd", "status", "--socket", service.socket, check=True).stdout
    assert "saves in flight: 0" in text
    assert "steps 1" in text


def test_unsupported_options_are_refused_clearly(service: Service, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="AsyncCheckpointWriter"):
        checkpointd.AsyncCheckpointWriter(str(tmp_path), service=service.socket)
    for options in ({"incremental": True}, {"staging": "overlapped"}):
        with pytest.raises(InvalidArgumentError, match="does not support"):
            checkpointd.CheckpointWriter(str(tmp_path), service=service.socket, **options)  # type: ignore[arg-type]


def test_no_service_at_a_path_is_a_service_error(tmp_path: Path) -> None:
    folder = socket_folder()
    try:
        with pytest.raises(ServiceError, match="no checkpoint service answers"):
            checkpointd.CheckpointWriter(str(tmp_path), service=os.path.join(folder, "sock"))
    finally:
        os.rmdir(folder)


def test_status_does_not_import_torch(service: Service) -> None:
    code = (
        "import sys\n"
        "from checkpointd.cli.main import main\n"
        "assert main(['status', '--socket', sys.argv[1], '--json']) == 0\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] == 'torch']\n"
        "assert not loaded, loaded[:5]\n"
    )
    done = run_python("-c", code, service.socket, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["saves_in_flight"] == 0


def test_status_without_a_service_is_one_clear_line() -> None:
    folder = socket_folder()
    try:
        done = run_python("-m", "checkpointd", "status", "--socket", f"{folder}/sock", check=False)
    finally:
        os.rmdir(folder)
    assert done.returncode == 1
    assert done.stderr.startswith("checkpointd status: error: no checkpoint service answers")
    assert len(done.stderr.splitlines()) == 1
