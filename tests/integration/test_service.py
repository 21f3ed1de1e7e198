"""The checkpoint service end to end: a real ``checkpointd serve`` process, real sockets
and shared memory; the writer and the CLI as a user runs them."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

import checkpointd
from checkpointd.daemon.client.client import status
from checkpointd.daemon.server.priority import io_priority
from checkpointd.errors import ServiceError
from tests.support.service import (
    Service,
    files_by_component,
    run_python,
    running_service,
    socket_folder,
    wait_for,
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


def _frozen_and_moving(step: int) -> dict[str, object]:
    """Four frozen 64 KiB tensors (referenced once written) and an adapter that changes."""
    frozen = torch.Generator().manual_seed(1234)
    moving = torch.Generator().manual_seed(step)
    return {
        "model": {
            **{f"base{i}": torch.randn(128, 128, generator=frozen) for i in range(4)},
            "lora": torch.randn(128, 128, generator=moving),
        },
        "meta": {"step": step},
    }


def _blob_names(root: Path) -> set[str]:
    return {p.name for p in (root / "blobs").iterdir() if not p.name.startswith(".")}


def test_incremental_saves_write_the_same_files_as_in_process(
    service: Service, tmp_path: Path
) -> None:
    infos: dict[str, list[checkpointd.CheckpointInfo]] = {}
    for name, where in (("inproc", None), ("svc", service.socket)):
        root = str(tmp_path / name)
        with checkpointd.CheckpointWriter(root, incremental=True, service=where) as writer:
            infos[name] = [
                writer.save(step, _frozen_and_moving(step)).result(30) for step in (1, 2, 3)
            ]
    frozen = 4 * 128 * 128 * 4
    assert [i.referenced_nbytes for i in infos["svc"]] == [0, frozen, frozen]
    assert [i.referenced_nbytes for i in infos["svc"]] == [
        i.referenced_nbytes for i in infos["inproc"]
    ]
    assert [i.written_nbytes for i in infos["svc"]] == [i.written_nbytes for i in infos["inproc"]]
    assert _blob_names(tmp_path / "svc") == _blob_names(tmp_path / "inproc")
    for step in (1, 2, 3):
        assert files_by_component(tmp_path / "svc", step) == files_by_component(
            tmp_path / "inproc", step
        )
        loaded = checkpointd.load(str(tmp_path / "svc"), step)
        expected = _frozen_and_moving(step)["model"]
        assert all(torch.equal(loaded.state["model"][k], v) for k, v in expected.items())  # type: ignore[attr-defined]
    # The memory tier holds whole checkpoints only: one with references reads storage.
    target = {k: torch.zeros(128, 128) for k in _frozen_and_moving(0)["model"]}  # type: ignore[attr-defined]
    info = checkpointd.restore(
        str(tmp_path / "svc"), {"model": target, "meta": {}}, service=service.socket
    )
    assert info.source == "storage"
    assert torch.equal(target["lora"], _frozen_and_moving(3)["model"]["lora"])  # type: ignore[index]


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


def test_the_service_runs_below_the_trainers_priority() -> None:
    # serve's defaults: niceness +10 (from the test's own) and best-effort I/O level 7
    with running_service(as_deployed=True) as service:
        assert os.getpriority(os.PRIO_PROCESS, service.proc.pid) == os.nice(0) + 10
        assert io_priority(service.proc.pid) == (2, 7)
    with running_service("--niceness", "0", "--io-priority", "none") as unchanged:
        assert os.getpriority(os.PRIO_PROCESS, unchanged.proc.pid) == os.nice(0)
        assert io_priority(unchanged.proc.pid) == io_priority()


def test_every_thread_of_the_service_runs_below_the_trainers_priority(tmp_path: Path) -> None:
    # Niceness and I/O class are per thread on Linux: the ones the service had before it
    # lowered its priority (numpy's OpenBLAS worker) must be lowered too, and the ones it
    # starts for a save inherit it.
    with (
        running_service(as_deployed=True) as service,
        checkpointd.CheckpointWriter(str(tmp_path / "root"), service=service.socket) as writer,
    ):
        writer.save(1, {"model": {"w": torch.randn(1024)}}).result(60)
        threads = [int(tid) for tid in os.listdir(f"/proc/{service.proc.pid}/task")]
        assert len(threads) > 2, threads
        shown = {
            tid: (os.getpriority(os.PRIO_PROCESS, tid) - os.nice(0), io_priority(tid))
            for tid in threads
        }
    assert all(value == (10, (2, 7)) for value in shown.values()), shown


def _write_calls(pid: int) -> int:
    """Write system calls process ``pid`` has made (all its threads), from /proc."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("syscw:"):
            return int(line.split()[1])
    raise AssertionError(f"no syscw in /proc/{pid}/io")


def test_the_writers_chunk_bytes_reaches_the_service(service: Service, tmp_path: Path) -> None:
    state = {"model": {"w": torch.randn(4 * 1024 * 1024)}}  # one 16 MiB tensor
    calls = {}
    for name, chunk in (("default", None), ("small", 4096)):
        options = {} if chunk is None else {"chunk_bytes": chunk}
        root = str(tmp_path / name)
        with checkpointd.CheckpointWriter(root, service=service.socket, **options) as writer:
            before = _write_calls(service.proc.pid)
            writer.save(1, state).result(60)
            calls[name] = _write_calls(service.proc.pid) - before
        assert torch.equal(checkpointd.load(root).state["model"]["w"], state["model"]["w"])
    # 16 MiB in 4 KiB writes is 4096 calls; in the default 16 MiB chunks a handful.
    assert calls["small"] >= 4096 > 10 * calls["default"], calls


def test_a_save_the_service_refuses_after_save_returned_fails_its_handle(
    service: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from checkpointd.daemon.client import remote
    from checkpointd.daemon.wire import protocol as p
    from checkpointd.daemon.wire import snapshot

    def out_of_bounds(captured: object) -> p.SnapshotDesc:
        desc = snapshot.describe(captured)  # type: ignore[arg-type]
        first = msgspec.structs.replace(desc.components[0], offset=1 << 40)
        return msgspec.structs.replace(desc, components=[first, *desc.components[1:]])

    root = str(tmp_path)
    with checkpointd.CheckpointWriter(root, service=service.socket) as writer:
        assert writer.save(1, {"t": torch.ones(4)}).result(60).step == 1
        monkeypatch.setattr(remote, "describe", out_of_bounds)
        handle = writer.save(2, {"t": torch.zeros(4)})  # returns before the service reads it
        with pytest.raises(ServiceError, match="spans bytes"):
            handle.result(60)
        monkeypatch.undo()
        with pytest.raises(ServiceError):  # the service closed that connection
            writer.save(3, {"t": torch.zeros(4)}).result(60)
    assert [c.step for c in checkpointd.list_checkpoints(root)] == [1]
    wait_for(lambda: status(service.socket).bytes_staged == 0)  # its segment freed


def test_segments_asked_for_ahead_are_used_or_given_back(service: Service, tmp_path: Path) -> None:
    root = str(tmp_path)
    sizes = [1, 4, 1, 1, 3]  # MiB: each save asks ahead for its predecessor's size
    with checkpointd.CheckpointWriter(root, service=service.socket) as writer:
        for step, mib in enumerate(sizes):
            if step == 3:  # refused before its capture reserves: the one asked ahead goes
                with pytest.raises(checkpointd.UnsupportedValueError):
                    writer.save(step + 10, {"x": object()})
                wait_for(lambda: status(service.socket).bytes_staged == 0)
            tensor = torch.full((mib * 2**18,), float(step))
            writer.save(step, {"t": tensor}).result(60)
            wait_for(lambda: status(service.socket).bytes_staged == 0)  # nothing left owned
            assert torch.equal(checkpointd.load(root, step).state["t"], tensor)


def _cuda_state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 256, device="cuda")).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_state_through_pinned_segments_and_back_from_memory(
    service: Service, tmp_path: Path
) -> None:
    """CUDA sources are copied into the service's segments, page-locked for the copies
    (cudaHostRegister, unregistered when a segment is dropped); the files are the
    in-process save's, and a restore from the memory tier lands them in CUDA tensors."""
    model, optimizer = _cuda_state(0)
    state = {"model": model, "optimizer": optimizer}
    with checkpointd.CheckpointWriter(str(tmp_path / "svc"), service=service.socket) as writer:
        for step in (1, 2, 3):  # later saves reuse a registered segment or register anew
            writer.save(step, state).result(60)
    with checkpointd.CheckpointWriter(str(tmp_path / "inproc")) as writer:
        writer.save(3, state).result(60)
    assert files_by_component(tmp_path / "svc", 3) == files_by_component(tmp_path / "inproc", 3)
    live_model, live_optimizer = _cuda_state(1)
    live = {"model": live_model, "optimizer": live_optimizer}
    info = checkpointd.restore(str(tmp_path / "svc"), live, service=service.socket)
    assert info.source == "memory"
    pairs = [(live_model.state_dict()[k], t) for k, t in model.state_dict().items()]
    for mine, theirs in zip(live_model.parameters(), model.parameters(), strict=True):
        pairs += [(live_optimizer.state[mine][k], t) for k, t in optimizer.state[theirs].items()]
    assert len(pairs) == 4 + 4 * 3  # weights and biases; step, exp_avg, exp_avg_sq of each
    for got, want in pairs:
        assert got.device == want.device  # the moments on the GPU (step stays a CPU scalar)
        assert torch.equal(got, want)
