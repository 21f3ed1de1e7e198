"""The service's memory tier and memory limit, with a real ``checkpointd serve``: a
restarted trainer restores from shared memory only when storage's newest committed
step is the very one held; ``--memory-limit`` evicts, holds saves back, or refuses."""

from __future__ import annotations

import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

import checkpointd
from checkpointd.daemon.client.client import connect, status
from checkpointd.daemon.wire import protocol as p
from checkpointd.daemon.wire.paths import parse_size
from checkpointd.daemon.wire.shm import map_fd
from checkpointd.errors import InvalidArgumentError, ServiceMemoryError
from tests.support.service import damage_held_copy, reap, running_service, trainer
from tests.support.service_jobs import expected_state

MIB = 1024 * 1024


class _Holder:
    """A restore target: a plain Stateful holding tensors."""

    def __init__(self) -> None:
        self.tensors = {name: torch.zeros_like(t) for name, t in expected_state(0).items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.tensors = {name: tensor.clone() for name, tensor in state.items()}


def _restore(root: str, socket: str, step: int | None = None) -> tuple[str, _Holder, int]:
    holder = _Holder()
    info = checkpointd.restore(root, {"model": holder}, step, service=socket)
    return info.source, holder, info.step


def _save(root: str, socket: str | None, steps: range, **options: object) -> None:
    with checkpointd.CheckpointWriter(root, service=socket, **options) as writer:  # type: ignore[arg-type]
        for step in steps:
            writer.save(step, {"model": expected_state(step)})
        writer.wait(60)


def test_a_restarted_trainer_restores_from_memory_bit_exact(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    with running_service() as service:
        proc = trainer(service.socket, root, 3)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.strip() == "returned 2":
                    proc.send_signal(signal.SIGKILL)
                    break
        finally:
            reap(proc)
        deadline = time.monotonic() + 30
        while status(service.socket).saves_in_flight or not status(service.socket).kept:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        source, holder, step = _restore(root, service.socket)
        assert (source, step) == ("memory", 2)
        for name, tensor in expected_state(2).items():
            assert torch.equal(holder.tensors[name], tensor)
        # without the service: the same bytes from storage
        assert _restore(root, None)[0] == "storage"  # type: ignore[arg-type]


def test_memory_is_never_served_when_storage_disagrees(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    with running_service() as service:
        _save(root, service.socket, range(1, 2))
        assert _restore(root, service.socket)[0] == "memory"
        # someone else commits a newer step: storage's newest is not held
        _save(root, None, range(2, 3))
        source, holder, step = _restore(root, service.socket)
        assert (source, step) == ("storage", 2)
        # step 1 asked for explicitly is still held and unchanged on storage
        assert _restore(root, service.socket, 1)[0] == "memory"
        # step 1 deleted and committed again with other bytes: storage's copy wins
        shutil.rmtree(Path(root) / f"{1:012d}")
        with checkpointd.CheckpointWriter(root, newer_steps="keep") as writer:
            writer.save(1, {"model": expected_state(5)}).result(60)
        source, holder, step = _restore(root, service.socket, 1)
        assert (source, step) == ("storage", 1)
        assert torch.equal(holder.tensors["weights"], expected_state(5)["weights"])
        # step 1 deleted: storage says nothing is there, whatever memory holds
        shutil.rmtree(Path(root) / f"{1:012d}")
        with pytest.raises(checkpointd.CheckpointNotFoundError):
            _restore(root, service.socket, 1)


def test_a_restarted_service_holds_nothing_stale(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    with running_service() as service:
        _save(root, service.socket, range(1, 2))
        assert _restore(root, service.socket)[0] == "memory"
    with running_service() as service:
        assert status(service.socket).kept == {}
        assert _restore(root, service.socket)[0] == "storage"


def test_keep_in_memory_counts_per_root(tmp_path: Path) -> None:
    with running_service("--keep-in-memory", "2") as service:
        _save(str(tmp_path / "a"), service.socket, range(4))
        _save(str(tmp_path / "b"), service.socket, range(1))
        kept = sorted(status(service.socket).kept.values())
        assert kept == [[0], [2, 3]]
    with running_service("--keep-in-memory", "0") as service:
        _save(str(tmp_path / "c"), service.socket, range(1))
        reply = status(service.socket)
        assert reply.kept == {}
        assert reply.bytes_kept == 0
        assert _restore(str(tmp_path / "c"), service.socket)[0] == "storage"


def _state_bytes() -> int:
    return sum(t.numel() * t.element_size() for t in expected_state(0).values())


def test_a_state_that_can_never_fit_fails_at_save(tmp_path: Path) -> None:
    with running_service("--memory-limit", str(_state_bytes() // 2)) as service:
        writer = checkpointd.CheckpointWriter(str(tmp_path / "r"), service=service.socket)
        with writer, pytest.raises(ServiceMemoryError, match="can never fit"):
            writer.save(1, {"model": expected_state(1)})
        assert status(service.socket).bytes_staged == 0
    assert checkpointd.list_checkpoints(str(tmp_path / "r")) == []


def test_memory_limit_evicts_kept_copies_then_holds_saves_back(tmp_path: Path) -> None:
    limit = str(_state_bytes() + 64 * 1024)  # one snapshot (aligned) fits, two do not
    gate = tmp_path / "gate"
    root = str(tmp_path / "r")
    with running_service("--memory-limit", limit, gate=str(gate)) as service:
        writer = checkpointd.CheckpointWriter(root, service=service.socket, max_pending=2)
        with writer:
            writer.save(1, {"model": expected_state(1)})  # held in flight by the gate
            returned = threading.Event()

            def second() -> None:
                writer.save(2, {"model": expected_state(2)})
                returned.set()

            thread = threading.Thread(target=second)
            thread.start()
            try:
                assert not returned.wait(1.5)  # no memory until step 1 resolves
                assert status(service.socket).saves_in_flight == 1
            finally:  # a failed check must not leave step 1 held (close would wait on it)
                gate.touch()
            thread.join(30)
            assert returned.is_set()
            writer.wait(60)
        reply = status(service.socket)
        assert list(reply.kept.values()) == [[2]]  # step 1's kept copy was evicted
        assert reply.bytes_staged + reply.bytes_kept <= int(limit)
    assert [c.step for c in checkpointd.list_checkpoints(root)] == [1, 2]


def test_sizes_parse_in_powers_of_1024() -> None:
    assert parse_size("512") == 512
    assert parse_size("4K") == 4096
    assert parse_size("2G") == 2 * 1024**3
    assert parse_size("1TiB") == 1024**4
    with pytest.raises(InvalidArgumentError):
        parse_size("lots")
    assert parse_size("1M") == MIB


def test_a_lent_segment_never_changes_and_a_module_lands_from_memory(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    model = torch.nn.Linear(256, 256)
    with running_service() as service:
        with checkpointd.CheckpointWriter(root, service=service.socket, keep_last=1) as writer:
            writer.save(1, {"model": model}).result(30)
            borrower = connect(service.socket, start=False)
            try:
                reply, fd = borrower.request(p.Lookup, root=root, storage_options=None, step=1)
                assert isinstance(reply, p.Held)
                assert fd is not None
                mapped = map_fd(fd, reply.size, writable=False)
                lent = bytes(mapped)
                for step in (2, 3, 4):  # each frees the one before: a spare, unless lent
                    with torch.no_grad():
                        model.weight.add_(1.0)
                    writer.save(step, {"model": model}).result(30)
                unchanged = bytes(mapped) == lent  # (not compared by pytest: a huge diff)
                assert unchanged
                assert status(service.socket).bytes_staged >= reply.size  # still counted
                mapped.close()
            finally:
                borrower.close()
        deadline = time.monotonic() + 10
        while status(service.socket).bytes_staged and time.monotonic() < deadline:
            time.sleep(0.02)
        assert status(service.socket).bytes_staged == 0  # given back at the borrower's end
        fresh = torch.nn.Linear(256, 256)
        info = checkpointd.restore(root, {"model": fresh}, service=service.socket)
    assert (info.source, info.step) == ("memory", 4)
    assert torch.equal(fresh.weight, model.weight)
    assert torch.equal(fresh.bias, model.bias)


def test_a_damaged_memory_copy_is_never_served(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    torch.manual_seed(0)
    model = torch.nn.Linear(1536, 1536)  # 9 MiB: copied from memory on two cores
    with running_service() as service:
        with checkpointd.CheckpointWriter(root, service=service.socket) as writer:
            writer.save(1, {"model": model}).result(30)
        fresh = torch.nn.Linear(1536, 1536)
        info = checkpointd.restore(root, {"model": fresh}, service=service.socket)
        assert (info.source, info.step) == ("memory", 1)
        assert torch.equal(fresh.weight, model.weight)
        assert torch.equal(fresh.bias, model.bias)
        damage_held_copy(service.proc.pid, service.socket, root, 1)
        fresh = torch.nn.Linear(1536, 1536)
        info = checkpointd.restore(root, {"model": fresh}, service=service.socket)
        assert (info.source, info.step) == ("storage", 1)
        assert torch.equal(fresh.weight, model.weight)
        # Storage damaged as well: storage's error, with a note that the memory copy
        # failed as it landed, so the weight may hold some of its bytes.
        (tensors,) = (Path(root) / f"{1:012d}").glob("model*.safetensors")
        data = bytearray(tensors.read_bytes())
        data[len(data) // 2] ^= 0xFF
        tensors.write_bytes(bytes(data))
        target = torch.nn.Linear(1536, 1536)
        with pytest.raises(checkpointd.CorruptCheckpointError) as failed:
            checkpointd.restore(root, {"model": target}, service=service.socket)
        assert tensors.name in str(failed.value)  # storage's own check names the file
        (note,) = failed.value.__notes__
        assert "memory copy failed" in note
        assert "may hold a mix" in note
        assert "['model']" in note
