"""restore() reading tensors straight into live memory (inplace.py): bit-exact, the live
tensors keep their memory, and all or nothing at every point a restore can fail."""

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
from checkpointd.read import inplace
from tests.conftest import Root


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64), nn.LayerNorm(64))


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _net(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(8, 64)).sum().backward()
        optimizer.step()
    return model, optimizer


def _save(root: Root, state: dict[str, Any]) -> None:
    with checkpointd.CheckpointWriter(root.url, storage_options=root.storage_options) as writer:
        writer.save(1, state).result(timeout=60)


def _restore(root: Root, targets: dict[str, Any]) -> checkpointd.RestoreInfo:
    return checkpointd.restore(root.url, targets, storage_options=root.storage_options)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _pointers(module: nn.Module) -> dict[str, int]:
    return {k: v.data_ptr() for k, v in module.state_dict().items()}


@pytest.fixture(params=["local", "memory"])
def root(request: pytest.FixtureRequest) -> Root:
    found: Root = request.getfixturevalue(f"{request.param}_root")
    return found


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 4 KiB, so every tensor file spans many chunks."""
    monkeypatch.setattr(tunables, "READ_CHUNK_BYTES", 4096)


@pytest.mark.usefixtures("small_chunks")
def test_restore_lands_in_the_live_tensors_bit_exact(root: Root) -> None:
    model, optimizer = _trained(0)
    weights = torch.randn(33, 7)
    table = {"a": torch.arange(10.0), "b": torch.ones(3, dtype=torch.int64)}
    _save(root, {"model": model, "optimizer": optimizer, "weights": weights, "table": table})
    live_model, live_optimizer = _trained(1)
    live_weights = torch.zeros(33, 7)
    live_table = {"a": torch.zeros(10), "b": torch.zeros(3, dtype=torch.int64)}
    pointers = _pointers(live_model)
    state_pointers = [t.data_ptr() for s in live_optimizer.state.values() for t in s.values()]
    weights_pointer = live_weights.data_ptr()
    _restore(
        root,
        {
            "model": live_model,
            "optimizer": live_optimizer,
            "weights": live_weights,
            "table": live_table,
        },
    )
    assert _equal(model.state_dict(), live_model.state_dict())
    assert _equal(optimizer.state_dict(), live_optimizer.state_dict())
    assert torch.equal(live_weights, weights)
    assert _equal(live_table, table)
    # The live tensors kept their memory: the bytes were read into it.
    assert _pointers(live_model) == pointers
    assert live_weights.data_ptr() == weights_pointer
    assert [
        t.data_ptr() for s in live_optimizer.state.values() for t in s.values()
    ] == state_pointers


def test_the_local_path_reads_into_live_memory_through_a_pinned_file(
    local_root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _ = _trained(0)
    _save(local_root, {"model": model})
    planned: list[inplace.Planned] = []
    original = inplace.read_for_restore

    def spy(*args: Any) -> inplace.Planned:
        result = original(*args)
        planned.append(result)
        return result

    monkeypatch.setattr(inplace, "read_for_restore", spy)
    live = _net(1)
    _restore(local_root, {"model": live})
    assert _equal(model.state_dict(), live.state_dict())
    (item,) = planned
    (landing,) = item.landings
    assert set(landing.direct) == set(live.state_dict())
    assert landing.source is None  # pinned, not read whole
    assert landing.pinned is None  # released


def test_tied_and_untied_weights(root: Root) -> None:
    class Tied(nn.Module):
        def __init__(self, tie: bool) -> None:
            super().__init__()
            self.a = nn.Linear(16, 16, bias=False)
            self.b = nn.Linear(16, 16, bias=False)
            if tie:
                self.b.weight = self.a.weight

    torch.manual_seed(0)
    saved = Tied(tie=True)
    _save(root, {"model": saved})
    for tie in (True, False):
        live = Tied(tie)
        _restore(root, {"model": live})
        assert torch.equal(live.a.weight, saved.a.weight)
        assert torch.equal(live.b.weight, saved.a.weight)


@pytest.mark.usefixtures("small_chunks")
def test_a_late_refusal_leaves_every_target_as_it_was(root: Root) -> None:
    class Picky:
        def __init__(self, count: int) -> None:
            self.count = count

        def state_dict(self) -> dict[str, Any]:
            return {"count": self.count}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            if state["count"] == 2:
                raise ValueError("injected: refused")
            self.count = state["count"]

    model, optimizer = _trained(0)
    _save(root, {"model": model, "optimizer": optimizer, "picky": Picky(2)})
    live_model, live_optimizer = _trained(1)
    before = (copy.deepcopy(live_model.state_dict()), copy.deepcopy(live_optimizer.state_dict()))
    with pytest.raises(checkpointd.RestoreMismatchError, match="injected"):
        _restore(root, {"model": live_model, "optimizer": live_optimizer, "picky": Picky(9)})
    assert _equal(before[0], live_model.state_dict())
    assert _equal(before[1], live_optimizer.state_dict())


def _tensor_file(step_dir: Path, component: str) -> Path:
    (found,) = [
        p
        for p in step_dir.iterdir()
        if p.name.startswith(component) and p.name.endswith(".safetensors")
    ]
    return found


@pytest.mark.usefixtures("small_chunks")
def test_damage_in_the_last_block_changes_nothing(local_root: Root) -> None:
    model, optimizer = _trained(0)
    _save(local_root, {"model": model, "optimizer": optimizer})
    path = _tensor_file(Path(local_root.url) / f"{1:012d}", "model")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    live_model, live_optimizer = _trained(1)
    before = (copy.deepcopy(live_model.state_dict()), copy.deepcopy(live_optimizer.state_dict()))
    with pytest.raises(checkpointd.CorruptCheckpointError, match="CRC32C"):
        checkpointd.restore(
            local_root.url, {"model": live_model, "optimizer": live_optimizer}, step=1
        )
    assert _equal(before[0], live_model.state_dict())
    assert _equal(before[1], live_optimizer.state_dict())


def test_a_file_deleted_after_the_check_pass_still_restores(
    local_root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _ = _trained(0)
    _save(local_root, {"model": model})
    original = inplace.read_for_restore

    def then_delete(reader: Any, *args: Any) -> inplace.Planned:
        result = original(reader, *args)
        for landing in result.landings:
            os.unlink(Path(local_root.url) / f"{1:012d}" / landing.file)
        return result

    monkeypatch.setattr(inplace, "read_for_restore", then_delete)
    live = _net(1)
    _restore(local_root, {"model": live})
    assert _equal(model.state_dict(), live.state_dict())


def test_a_file_changed_after_the_check_pass_is_reported_and_the_rest_rolled_back(
    local_root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = _trained(0)
    _save(local_root, {"model": model, "optimizer": optimizer})
    original = inplace.read_for_restore

    def then_scribble(reader: Any, name: str, *args: Any) -> inplace.Planned:
        result = original(reader, name, *args)
        for landing in result.landings:
            if name == "model":
                path = Path(local_root.url) / f"{1:012d}" / landing.file
                os.chmod(path, 0o644)
                with open(path, "r+b") as f:
                    f.seek(-1, os.SEEK_END)
                    last = f.read(1)[0]
                    f.seek(-1, os.SEEK_END)
                    f.write(bytes([last ^ 0xFF]))
        return result

    monkeypatch.setattr(inplace, "read_for_restore", then_scribble)
    live_model, live_optimizer = _trained(1)
    before = copy.deepcopy(live_optimizer.state_dict())
    with pytest.raises(checkpointd.CorruptCheckpointError, match=r"changed while.*'model'"):
        _restore(local_root, {"model": live_model, "optimizer": live_optimizer})
    # Only the model's tensors may be part restored; the optimizer is as it was.
    assert _equal(before, live_optimizer.state_dict())


def test_a_module_with_hooks_takes_the_usual_path(root: Root) -> None:
    model = _net(0)
    _save(root, {"model": model})
    live = _net(1)
    seen: list[str] = []
    live.register_load_state_dict_post_hook(lambda module, keys: seen.append("post"))
    assert inplace.lands_in_place(live) is None
    _restore(root, {"model": live})
    assert seen == ["post"]
    assert _equal(model.state_dict(), live.state_dict())


def test_an_optimizer_with_a_tensor_learning_rate(root: Root) -> None:
    def make(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = _net(seed)
        optimizer = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01 * (seed + 1)))
        model(torch.randn(8, 64)).sum().backward()
        optimizer.step()
        return model, optimizer

    model, optimizer = make(0)
    _save(root, {"model": model, "optimizer": optimizer})
    live_model, live_optimizer = make(1)
    _restore(root, {"model": live_model, "optimizer": live_optimizer})
    assert _equal(optimizer.state_dict(), live_optimizer.state_dict())
    assert float(live_optimizer.param_groups[0]["lr"]) == pytest.approx(0.01)


def test_autograd_sees_the_live_tensors_change(root: Root) -> None:
    """A backward through a graph that saved the old weights fails, as after a copy_."""
    model = _net(0)
    _save(root, {"model": model})
    live = _net(1)
    loss = (live(torch.randn(2, 64)) ** 2).sum()
    _restore(root, {"model": live})
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
