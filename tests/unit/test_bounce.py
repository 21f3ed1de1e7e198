"""The bounce path device tensors take (read/bounce.py, landing.py, todevice.py), run on
CPU: ``tunables.BOUNCE_CPU_TARGETS`` forces CPU targets through it, with a small bounce
buffer so every file spans many blocks. The CUDA tests at the end need a device."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import checkpointd
from checkpointd import tunables
from checkpointd.format.checksum import crc32c
from checkpointd.read import bounce, inplace
from checkpointd.read.bounce import Bounce, HostTransfer, Piece
from tests.conftest import Root

BLOCK = 1000
"""Half the bounce buffer in these tests: not a power of two, so blocks end mid-tensor."""


@pytest.fixture
def forced(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """CPU targets through the bounce path, blocks of ``BLOCK`` bytes, check-pass chunks of
    4 KiB; returns the sizes of the copies made out of staging, as they are made."""
    monkeypatch.setattr(tunables, "BOUNCE_CPU_TARGETS", True)
    monkeypatch.setattr(tunables, "BOUNCE_BYTES", 2 * BLOCK)
    monkeypatch.setattr(tunables, "READ_CHUNK_BYTES", 4096)
    copies: list[int] = []
    original = HostTransfer.copy

    def counted(self: HostTransfer, dst: torch.Tensor, src: torch.Tensor) -> None:
        copies.append(src.numel())
        original(self, dst, src)

    monkeypatch.setattr(HostTransfer, "copy", counted)
    return copies


@pytest.fixture(params=["local", "memory"])
def root(request: pytest.FixtureRequest) -> Root:
    found: Root = request.getfixturevalue(f"{request.param}_root")
    return found


class _Odd(nn.Module):
    """Odd sizes and dtypes; ``big`` is larger than the whole bounce buffer."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(33, 7)
        self.b = nn.Linear(7, 301, bias=False)
        self.register_buffer("big", torch.randn(1237))
        self.register_buffer("f16", torch.randn(17).half())
        self.register_buffer("count", torch.randint(0, 99, (3,)))
        self.register_buffer("flags", torch.rand(5) > 0.5)


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _Odd(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        model.b(model.a(torch.randn(4, 33))).sum().backward()
        optimizer.step()
    return model, optimizer


def _save(root: Root, state: dict[str, Any], step: int = 1) -> None:
    with checkpointd.CheckpointWriter(root.url, storage_options=root.storage_options) as writer:
        writer.save(step, state).result(timeout=60)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _tensor_file(root: Root, component: str, step: int = 1) -> Path:
    (found,) = (Path(root.url) / f"{step:012d}").glob(f"{component}*.safetensors")
    return found


def _flip_middle_byte(path: Path) -> None:
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)[0]
        f.seek(path.stat().st_size // 2)
        f.write(bytes([byte ^ 0x5A]))


class _Deferred:
    """A transfer that, like a DMA, reads its source only later: at ``wait``. A staging
    block reused before ``wait`` would land the wrong bytes."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.pinned = False
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.copies = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.pending.append((dst, src))
        self.copies += 1

    def wait(self) -> None:
        while self.pending:
            dst, src = self.pending.pop(0)
            dst.copy_(src)


def test_stream_lands_every_byte_and_checksums_the_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tunables, "BOUNCE_BYTES", 2 * 7)
    deferred = _Deferred()
    monkeypatch.setattr(bounce, "transfer_for", lambda device: deferred)
    data = bytes(range(256)) * 3 + b"tail"
    header, middle = memoryview(data[:10]), memoryview(data[100:123])
    first = torch.zeros(90, dtype=torch.uint8)
    last = torch.zeros(len(data) - 123, dtype=torch.uint8)

    def read(view: memoryview, offset: int) -> None:
        view[:] = data[offset : offset + len(view)]

    with Bounce() as staging:
        items = [header, Piece(first, 10), middle, Piece(last, 123)]
        digest = staging.stream(read, items)
        blocks = staging._blocks  # noqa: SLF001
        assert [b.numel() for b in blocks] == [7, 7]  # two blocks of 7, whatever the size
    assert staging._blocks == []  # noqa: SLF001 - freed by close
    assert digest == crc32c(data)
    assert bytes(first.numpy()) == data[10:100]
    assert bytes(last.numpy()) == data[123:]
    assert deferred.copies == -(-90 // 7) + -(-len(last) // 7)


def test_restore_through_the_bounce_path_is_bit_exact(root: Root, forced: list[int]) -> None:
    model, optimizer = _trained(0)
    weights = torch.randn(3001)  # 12 KB: a dozen blocks
    _save(root, {"model": model, "optimizer": optimizer, "weights": weights})
    live_model, live_optimizer = _trained(1)
    live_weights = torch.zeros(3001)
    pointers = {k: v.data_ptr() for k, v in live_model.state_dict().items()}
    checkpointd.restore(
        root.url,
        {"model": live_model, "optimizer": live_optimizer, "weights": live_weights},
        storage_options=root.storage_options,
    )
    assert _equal(model.state_dict(), live_model.state_dict())
    assert _equal(optimizer.state_dict(), live_optimizer.state_dict())
    assert torch.equal(weights, live_weights)
    assert {k: v.data_ptr() for k, v in live_model.state_dict().items()} == pointers
    if root.kind == "local":  # pinned files land through the blocks; others copy whole
        assert forced
        assert max(forced) == BLOCK
        assert sum(forced) >= weights.numel() * 4 + model.big.numel() * 4


def test_restore_through_an_asynchronous_copy(
    local_root: Root, forced: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copies that complete only at ``wait`` (as a DMA does) still land the right bytes."""
    model, optimizer = _trained(0)
    _save(local_root, {"model": model, "optimizer": optimizer})
    deferred = _Deferred()
    monkeypatch.setattr(bounce, "transfer_for", lambda device: deferred)
    live_model, live_optimizer = _trained(1)
    checkpointd.restore(local_root.url, {"model": live_model, "optimizer": live_optimizer})
    assert deferred.copies > 10
    assert _equal(model.state_dict(), live_model.state_dict())
    assert _equal(optimizer.state_dict(), live_optimizer.state_dict())


def test_damage_in_the_middle_leaves_every_target_untouched(
    local_root: Root, forced: list[int]
) -> None:
    model, optimizer = _trained(0)
    _save(local_root, {"model": model, "optimizer": optimizer})
    _flip_middle_byte(_tensor_file(local_root, "model"))
    live_model, live_optimizer = _trained(1)
    before = (copy.deepcopy(live_model.state_dict()), copy.deepcopy(live_optimizer.state_dict()))
    with pytest.raises(checkpointd.CorruptCheckpointError, match="CRC32C"):
        checkpointd.restore(
            local_root.url, {"model": live_model, "optimizer": live_optimizer}, step=1
        )
    assert forced == []  # refused in the check pass: nothing was copied out of staging
    assert _equal(before[0], live_model.state_dict())
    assert _equal(before[1], live_optimizer.state_dict())


def test_a_file_changed_before_landing_is_reported_and_the_rest_rolled_back(
    local_root: Root, forced: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = _trained(0)
    _save(local_root, {"model": model, "optimizer": optimizer})
    original = inplace.read_for_restore

    def then_scribble(reader: Any, name: str, *args: Any) -> inplace.Planned:
        result = original(reader, name, *args)
        if name == "model":
            _flip_middle_byte(_tensor_file(local_root, "model"))
        return result

    monkeypatch.setattr(inplace, "read_for_restore", then_scribble)
    live_model, live_optimizer = _trained(1)
    before = copy.deepcopy(live_optimizer.state_dict())
    with pytest.raises(checkpointd.CorruptCheckpointError, match=r"changed while.*'model'"):
        checkpointd.restore(local_root.url, {"model": live_model, "optimizer": live_optimizer})
    assert forced  # the landing had begun
    assert _equal(before, live_optimizer.state_dict())


def test_load_to_a_device_through_the_bounce_path(root: Root, forced: list[int]) -> None:
    model, optimizer = _trained(0)
    _save(root, {"model": model, "optimizer": optimizer, "step": 7})
    loaded = checkpointd.load(root.url, map_location="cpu", storage_options=root.storage_options)
    assert _equal(model.state_dict(), loaded.state["model"])
    assert _equal(optimizer.state_dict()["state"], loaded.state["optimizer"]["state"])
    assert loaded.state["step"] == 7
    if root.kind == "local":
        assert forced
        assert max(forced) == BLOCK


def test_load_to_a_device_refuses_damage_and_falls_back(
    local_root: Root, forced: list[int]
) -> None:
    old, _ = _trained(0)
    new, _ = _trained(1)
    _save(local_root, {"model": old}, step=1)
    _save(local_root, {"model": new}, step=2)
    _flip_middle_byte(_tensor_file(local_root, "model", step=2))
    with pytest.raises(checkpointd.CorruptCheckpointError, match="CRC32C"):
        checkpointd.load(local_root.url, step=2, map_location="cpu")
    with pytest.warns(checkpointd.CheckpointWarning, match="skipping step 2"):
        loaded = checkpointd.load(local_root.url, map_location="cpu")
    assert loaded.info.step == 1
    assert _equal(old.state_dict(), loaded.state["model"])


# --- CUDA ----------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@needs_cuda
def test_cuda_restore_lands_through_pinned_staging(
    local_root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tunables, "BOUNCE_BYTES", 2 * 2**16)
    model, optimizer = _trained(0)
    _save(local_root, {"model": model, "optimizer": optimizer})
    live_model = _Odd(1).cuda()
    live_optimizer = torch.optim.AdamW(live_model.parameters(), lr=0.01)
    live_model.b(live_model.a(torch.randn(4, 33, device="cuda"))).sum().backward()
    live_optimizer.step()
    pointers = {k: v.data_ptr() for k, v in live_model.state_dict().items()}
    pinned: list[bool] = []
    original = bounce.CudaTransfer.copy

    def spy(self: bounce.CudaTransfer, dst: torch.Tensor, src: torch.Tensor) -> None:
        pinned.append(src.is_pinned())
        original(self, dst, src)

    monkeypatch.setattr(bounce.CudaTransfer, "copy", spy)
    checkpointd.restore(local_root.url, {"model": live_model, "optimizer": live_optimizer})
    assert pinned
    assert all(pinned)
    assert {k: v.data_ptr() for k, v in live_model.state_dict().items()} == pointers
    assert _equal(model.state_dict(), {k: v.cpu() for k, v in live_model.state_dict().items()})
    saved = optimizer.state_dict()["state"]
    for key, state in live_optimizer.state_dict()["state"].items():
        assert _equal(saved[key], {k: v.cpu() for k, v in state.items()})


@pytest.mark.cuda
@needs_cuda
def test_cuda_damage_leaves_cuda_targets_untouched(local_root: Root) -> None:
    model, _ = _trained(0)
    _save(local_root, {"model": model})
    _flip_middle_byte(_tensor_file(local_root, "model"))
    live = _Odd(1).cuda()
    before = {k: v.clone() for k, v in live.state_dict().items()}
    with pytest.raises(checkpointd.CorruptCheckpointError, match="CRC32C"):
        checkpointd.restore(local_root.url, {"model": live}, step=1)
    assert _equal(before, live.state_dict())


@pytest.mark.cuda
@needs_cuda
def test_cuda_load_map_location(local_root: Root, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tunables, "BOUNCE_BYTES", 2 * 2**16)
    model, _ = _trained(0)
    _save(local_root, {"model": model})
    loaded = checkpointd.load(local_root.url, map_location="cuda")
    state = loaded.state["model"]
    assert all(t.is_cuda for t in state.values())
    assert _equal(model.state_dict(), {k: v.cpu() for k, v in state.items()})


@pytest.mark.cuda
@needs_cuda
def test_cuda_without_an_index_is_the_calling_threads_device() -> None:
    found = bounce.resolved(torch.device("cuda"))
    assert found == torch.device("cuda", torch.cuda.current_device())
    assert bounce.resolved(torch.device("cpu")) == torch.device("cpu")
