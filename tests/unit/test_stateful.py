"""Stateful components: every kind of training state round-trips through a checkpoint."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import checkpointd
from checkpointd.state.fit import check_state
from checkpointd.state.loading import load_component
from checkpointd.state.stateful import component_state, unwrap
from tests.conftest import Root


class CompiledLike(nn.Module):
    """What torch.compile returns: the real model as ``_orig_mod`` (its state dict keys
    carry a ``_orig_mod.`` prefix). torch.compile itself takes ~10 s to import on CPU."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self._orig_mod = inner


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def _save(root: Root, state: dict[str, Any], step: int = 1) -> None:
    with checkpointd.CheckpointWriter(root.url, storage_options=root.storage_options) as writer:
        writer.save(step, state).result(timeout=60)


def _restore(root: Root, targets: dict[str, Any], **kwargs: Any) -> checkpointd.RestoreInfo:
    return checkpointd.restore(root.url, targets, storage_options=root.storage_options, **kwargs)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_unwrap_strips_every_wrapper() -> None:
    inner = nn.Linear(2, 2)
    assert unwrap(nn.DataParallel(inner)) is inner
    assert unwrap(CompiledLike(inner)) is inner
    assert unwrap(CompiledLike(nn.DataParallel(CompiledLike(inner)))) is inner
    assert list(component_state(CompiledLike(inner), "m")) == ["weight", "bias"]


@pytest.mark.parametrize(
    ("wrap_saved", "wrap_live"),
    [(nn.DataParallel, lambda m: m), (lambda m: m, CompiledLike), (CompiledLike, nn.DataParallel)],
)
def test_wrapped_and_plain_models_restore_into_each_other(
    memory_root: Root, wrap_saved: Any, wrap_live: Any
) -> None:
    torch.manual_seed(0)
    saved = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    expected = _params(saved)
    _save(memory_root, {"model": wrap_saved(saved)})
    torch.manual_seed(1)
    live = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    _restore(memory_root, {"model": wrap_live(live)})
    for key, value in expected.items():
        assert torch.equal(live.state_dict()[key], value), key


@pytest.fixture
def process_group() -> Iterator[None]:
    """A gloo process group of one, so a real DistributedDataParallel can be built on CPU."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("process_group")
def test_ddp_model_restores_into_a_plain_one_and_back(memory_root: Root) -> None:
    torch.manual_seed(0)
    saved = nn.Linear(4, 3)
    expected = _params(saved)
    ddp = nn.parallel.DistributedDataParallel(saved)
    assert list(ddp.state_dict()) == ["module.weight", "module.bias"]
    _save(memory_root, {"model": ddp})
    plain = nn.Linear(4, 3)
    _restore(memory_root, {"model": plain})
    _assert_params(plain, expected)

    _save(memory_root, {"model": plain}, step=2)
    torch.manual_seed(1)
    live = nn.Linear(4, 3)
    _restore(memory_root, {"model": nn.parallel.DistributedDataParallel(live)})
    _assert_params(live, expected)


def _assert_params(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def test_tied_weights_are_restored_tied(memory_root: Root) -> None:
    torch.manual_seed(0)
    model = Tied()
    expected = model.embed.weight.detach().clone()
    _save(memory_root, {"model": model})
    stored = checkpointd.load(memory_root.url).state["model"]
    assert stored["head.weight"] is stored["embed.weight"]  # stored once, loaded once
    with torch.no_grad():
        model.embed.weight.zero_()
    _restore(memory_root, {"model": model})
    assert model.head.weight is model.embed.weight
    assert torch.equal(model.embed.weight, expected)
    with torch.no_grad():
        model.embed.weight.add_(1)  # still one tensor: changing one changes the other
    assert torch.equal(model.head.weight, expected + 1)


def _trained() -> tuple[nn.Module, torch.optim.Optimizer, Any, torch.amp.GradScaler]:
    model = nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=20)
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0, growth_interval=2)
    return model, optimizer, scheduler, scaler


def _step(model: nn.Module, optimizer: Any, scheduler: Any, scaler: Any) -> None:
    loss = model(torch.randn(5, 4)).square().mean()
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()


def test_optimizer_scheduler_and_grad_scaler_continue_exactly(memory_root: Root) -> None:
    torch.manual_seed(0)
    first = _trained()
    for _ in range(3):
        _step(*first)
    _save(memory_root, dict(zip(["model", "optimizer", "scheduler", "scaler"], first, strict=True)))
    torch.manual_seed(5)
    for _ in range(4):
        _step(*first)
    straight = _params(first[0]), first[1].param_groups[0]["lr"], first[3].get_scale()

    torch.manual_seed(9)
    second = _trained()
    _restore(
        memory_root, dict(zip(["model", "optimizer", "scheduler", "scaler"], second, strict=True))
    )
    assert second[3].get_scale() != 64.0  # the scaler's state came back, not its defaults
    torch.manual_seed(5)
    for _ in range(4):
        _step(*second)
    for key, value in straight[0].items():
        assert torch.equal(second[0].state_dict()[key], value), key
    assert second[1].param_groups[0]["lr"] == straight[1]
    assert second[3].get_scale() == straight[2]


def test_generators_of_every_kind_round_trip(memory_root: Root) -> None:
    def make() -> dict[str, Any]:
        return {
            "torch_gen": torch.Generator().manual_seed(1),
            "pcg64": np.random.default_rng(2),  # 128-bit integers in its state
            "philox": np.random.Generator(np.random.Philox(3)),  # uint64 arrays
            "legacy": np.random.RandomState(4),
            "py": random.Random(5),
        }

    def draw(g: dict[str, Any]) -> list[Any]:
        return [
            torch.rand(3, generator=g["torch_gen"]).tolist(),
            g["pcg64"].random(3).tolist(),
            g["philox"].integers(0, 2**62, 3).tolist(),
            g["legacy"].normal(size=3).tolist(),
            g["py"].random(),
        ]

    live = make()
    draw(live)
    live["legacy"].normal()  # odd number of normals: a cached gaussian in the state
    _save(memory_root, live)
    expected = draw(live)
    fresh = make()
    info = _restore(memory_root, fresh)
    assert set(info.restored) == set(fresh)
    assert draw(fresh) == expected


def test_generator_of_another_kind_or_device_is_refused() -> None:
    pcg = component_state(np.random.default_rng(0), "g")
    with pytest.raises(checkpointd.RestoreMismatchError, match="PCG64"):
        check_state(np.random.Generator(np.random.Philox(0)), pcg, "g")
    cuda_like = dict(component_state(torch.Generator(), "g"), device="cuda:0")
    with pytest.raises(checkpointd.RestoreMismatchError, match="cuda:0"):
        check_state(torch.Generator(), cuda_like, "g")


class Counter:
    """A user object: any class with state_dict/load_state_dict is a component."""

    def __init__(self) -> None:
        self.count = 0
        self.seen: list[str] = []

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "seen": list(self.seen)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]
        self.seen = list(state["seen"])


def test_user_objects_tensors_and_dicts_restore_in_place(memory_root: Root) -> None:
    counter = Counter()
    counter.count, counter.seen = 3, ["a", "b"]
    ema = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    config = {"lr": 0.5, "layers": [1, 2]}
    _save(memory_root, {"counter": counter, "ema": ema, "config": config})
    live_counter, live_ema, live_config = Counter(), torch.zeros(2, 3, dtype=torch.float64), {}
    _restore(memory_root, {"counter": live_counter, "ema": live_ema, "config": live_config})
    assert (live_counter.count, live_counter.seen) == (3, ["a", "b"])
    assert torch.equal(live_ema, ema)
    assert live_config == config


def test_tensor_of_another_dtype_is_refused_not_cast(memory_root: Root) -> None:
    _save(memory_root, {"ema": torch.ones(4, dtype=torch.float64)})
    live = torch.zeros(4, dtype=torch.float32)
    with pytest.raises(checkpointd.RestoreMismatchError, match=r"float64"):
        _restore(memory_root, {"ema": live})
    assert torch.equal(live, torch.zeros(4))


def test_training_progress_resumes_a_shuffled_loader_mid_epoch() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(20))

    def loader(g: torch.Generator) -> torch.utils.data.DataLoader[Any]:
        return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=g)

    g = torch.Generator().manual_seed(0)
    straight = checkpointd.TrainingProgress()
    order = [b[0].tolist() for _ in range(3) for b in straight.epoch_batches(loader(g), g)]

    g = torch.Generator().manual_seed(0)
    first = checkpointd.TrainingProgress()
    seen = []
    for batch in first.epoch_batches(loader(g), g):
        seen.append(batch[0].tolist())
    for batch in first.epoch_batches(loader(g), g):
        seen.append(batch[0].tolist())
        if first.batch_in_epoch == 2:
            break
    saved = first.state_dict()

    g = torch.Generator().manual_seed(12345)  # the generator's own state need not be saved
    resumed = checkpointd.TrainingProgress()
    resumed.load_state_dict(saved)
    assert (resumed.epoch, resumed.step, resumed.batch_in_epoch) == (1, 7, 2)
    while resumed.epoch < 3:
        seen += [b[0].tolist() for b in resumed.epoch_batches(loader(g), g)]
    assert seen == order
    assert order[:5] != order[5:10]  # the epochs are shuffled differently


def _sampler(**options: Any) -> torch.utils.data.distributed.DistributedSampler[Any]:
    data = torch.utils.data.TensorDataset(torch.arange(21))
    defaults: dict[str, Any] = {"num_replicas": 2, "rank": 1}
    return torch.utils.data.distributed.DistributedSampler(data, **{**defaults, **options})


def test_the_dict_given_to_save_restores_per_rank_targets_in_place(memory_root: Root) -> None:
    """Saved alone, a PerRank component is an ordinary one; the same dict restores it."""
    counter = Counter()
    counter.count = 4
    _save(memory_root, {"c": checkpointd.PerRank(counter)})
    fresh = Counter()
    info = _restore(memory_root, {"c": checkpointd.PerRank(fresh)})
    assert info.restored == ("c",)
    assert fresh.count == 4


def test_a_distributed_sampler_is_a_component(memory_root: Root) -> None:
    """Its epoch and seed come back (its order is a function of them); no state_dict."""
    sampler = _sampler(seed=5)
    sampler.set_epoch(3)
    _save(memory_root, {"loader": checkpointd.PerRank(sampler)})
    assert checkpointd.load(memory_root.url).state["loader"]["epoch"] == 3
    fresh = _sampler()
    assert list(fresh) != list(sampler)
    info = _restore(memory_root, {"loader": checkpointd.PerRank(fresh)})
    assert info.restored == ("loader",)
    assert (fresh.epoch, fresh.seed) == (3, 5)
    assert list(fresh) == list(sampler)  # the same order of indices


@pytest.mark.parametrize(
    ("option", "value"), [("num_replicas", 3), ("rank", 0), ("shuffle", False), ("drop_last", True)]
)
def test_a_sampler_for_another_partition_is_refused(
    memory_root: Root, option: str, value: Any
) -> None:
    sampler = _sampler()
    sampler.set_epoch(2)
    _save(memory_root, {"loader": sampler})
    other = _sampler(**{option: value})
    with pytest.raises(checkpointd.RestoreMismatchError, match=option):
        _restore(memory_root, {"loader": other})
    assert other.epoch == 0


def test_load_component_errors_name_the_component() -> None:
    """Each refusal says which component it is about, not "optimizer" or "?"."""
    model = nn.Linear(2, 2)
    adam = torch.optim.Adam(model.parameters())
    by_name = {"state": {}, "param_groups": [{"params": ["weight", "bias"], "lr": 0.1}]}
    with pytest.raises(checkpointd.RestoreMismatchError, match=r"^adam: .*saved by parameter name"):
        load_component("adam", adam, by_name, {})
    with pytest.raises(checkpointd.RestoreMismatchError, match=r"component 'answer' \(int\)"):
        load_component("answer", 42, 41)
    with pytest.raises(checkpointd.RestoreMismatchError, match=r"component 'loader'.*num_replicas"):
        load_component("loader", _sampler(num_replicas=3), component_state(_sampler(), "loader"))
    with pytest.raises(checkpointd.RestoreMismatchError, match=r"component 'ema'.*\[3\]"):
        load_component("ema", torch.zeros(2), torch.zeros(3))
