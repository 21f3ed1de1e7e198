"""One rank of a sharded (DTensor) job for the resharding tests, run as a subprocess.

    python -m tests.support.shard_job ACTION MODE ROOT OUT RANK WORLD PORT

ACTION ``save`` builds a small MLP, shards it by MODE, trains two steps and saves
step 1 with a CheckpointWriter of the default group; ``restore`` builds the same
model from another seed, shards it by MODE on this world size and restores it.
Either way rank 0 then writes OUT/{ACTION}.pt: the full model and optimizer state
by parameter name (gathered by torch.distributed.checkpoint.state_dict, not by
checkpointd), and OUT/{ACTION}_next.pt: the same after one more training step;
every rank writes OUT/rank{RANK}.json (``ok``, ``error``,
``message``, ``blocked``: seconds save() blocked). MODE: ``fsdp2`` (fully_shard
on a 1-D mesh), ``hsdp`` (fully_shard on a (2, WORLD/2) mesh: Replicate, Shard),
``tp`` (ColwiseParallel/RowwiseParallel), ``ddp``, ``plain`` (no process group;
WORLD must be 1). ACTION ``refused`` tries saves that must be refused (see
``refused``). Environment: CHECKPOINTD_TEST_OPTIONS
(JSON storage options, for S3), CHECKPOINTD_TEST_BLOCK (the shard block size at
save), CHECKPOINTD_TEST_INCREMENTAL=1 (save with incremental=True),
CHECKPOINTD_TEST_TRAIN_STEPS (training steps before ``save``, default 2),
CHECKPOINTD_TEST_SHARD_INDEX=1 (shard entries in shard index files whatever the job's
size: tunables.SHARD_INDEX_MIN_ENTRIES 0), CHECKPOINTD_TEST_SERVICES (comma-separated
socket paths: rank R saves through the checkpoint service at the R-th, or restores with
``service=`` that one; its store is then the job's TCP store, hosted by rank 0's process
as tcp:// init hosts it), CHECKPOINTD_TEST_STAGING (the writer's ``staging``; with
``overlapped`` the copy is held until ``save()`` returned, reported as
``staged_at_return``, then the training step after the save runs while it copies),
CHECKPOINTD_TEST_ASYNC=1 (save with an AsyncCheckpointWriter under asyncio),
CHECKPOINTD_TEST_REPLICAS (the writer's ``replicas``, with services),
CHECKPOINTD_TEST_STEP (the step ``save`` saves, default 1). Reports also
carry ``shard_bytes_read``: distinct bytes this rank read from shard files on storage
(local or fsspec; not those the memory tier served), ``indexes_read``: the shard index
files it read, and for a restore ``source``: its ``RestoreInfo.source``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import threading
import time
from typing import Any

import anyio
import torch
import torch.distributed as dist

import checkpointd
from checkpointd import tunables
from checkpointd.storage.fsspec import FsspecStore
from checkpointd.storage.local import LocalStore
from checkpointd.write import staging

DIMS = (16, 24, 10)  # 24 and 10 split unevenly over 3 and 4 ranks


def build(mode: str, world: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The MLP sharded by ``mode`` and an AdamW over it."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(DIMS[0], DIMS[1]), torch.nn.ReLU(), torch.nn.Linear(DIMS[1], DIMS[2])
    )
    if mode in ("fsdp2", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if mode == "fsdp2":
            mesh = init_device_mesh("cpu", (world,))
        else:
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif mode == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    elif mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    return model, optimizer


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    generator = torch.Generator().manual_seed(7)
    for _ in range(steps):
        batch = torch.randn(8, DIMS[0], generator=generator)
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state with whole tensors, by parameter name (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    # copies: tensors that are not gathered (the step counters) are the live ones
    return copy.deepcopy({"model": model_state, "optimizer": optim_state["state"]})


def count_shard_reads(result: dict[str, Any]) -> None:
    """Keep ``result["shard_bytes_read"]`` at the distinct bytes this rank read from shard
    files (``*.rankR.safetensors``), by path or through a pinned file (restore reads a
    box twice: checked, then into the live tensor; counted once)."""
    result["shard_bytes_read"] = 0
    seen: dict[str, set[tuple[int, int]]] = {}

    result["indexes_read"] = []

    def note(path: str, offset: int, size: int) -> None:
        name = path.rsplit("/", 1)[-1]
        if name.startswith("shards.") and name not in result["indexes_read"]:
            result["indexes_read"].append(name)
        if ".rank" in path and path.endswith(".safetensors"):
            spans = seen.setdefault(path, set())
            spans.add((offset, offset + size))
            result["shard_bytes_read"] = sum(_union(s) for s in seen.values())

    for cls in (LocalStore, FsspecStore):
        original = cls.read_into

        def read_into(
            self: Any, path: str, buffer: memoryview, offset: int = 0, _original: Any = original
        ) -> None:
            note(path, offset, buffer.nbytes)
            _original(self, path, buffer, offset)

        cls.read_into = read_into  # type: ignore[method-assign]
    open_pinned = LocalStore.open_pinned

    def pinned(self: LocalStore, path: str) -> Any:
        handle = open_pinned(self, path)
        read = handle.read_into

        def counted(buffer: memoryview, offset: int = 0) -> None:
            note(path, offset, buffer.nbytes)
            read(buffer, offset)

        handle.read_into = counted  # type: ignore[method-assign]
        return handle

    LocalStore.open_pinned = pinned  # type: ignore[method-assign]


def _union(spans: set[tuple[int, int]]) -> int:
    """Bytes covered by the (begin, end) spans."""
    total, reach = 0, 0
    for begin, end in sorted(spans):
        if end > reach:
            total += end - max(begin, reach)
            reach = end
    return total


def main() -> None:
    action, mode, root, out, rank_s, world_s, port = sys.argv[1:]
    rank, world = int(rank_s), int(world_s)
    options = json.loads(os.environ.get("CHECKPOINTD_TEST_OPTIONS", "null"))
    if "CHECKPOINTD_TEST_BLOCK" in os.environ:
        tunables.SHARD_BLOCK_BYTES = int(os.environ["CHECKPOINTD_TEST_BLOCK"])
    if os.environ.get("CHECKPOINTD_TEST_SHARD_INDEX") == "1":
        tunables.SHARD_INDEX_MIN_ENTRIES = 0
    if mode != "plain":
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
    result: dict[str, Any] = {"ok": False, "error": None, "message": "", "blocked": 0.0}
    count_shard_reads(result)
    if action == "refused":
        refused(root, mode, world, result)
        _report(out, rank, result)
        dist.destroy_process_group()
        return
    services = os.environ.get("CHECKPOINTD_TEST_SERVICES")
    service = services.split(",")[rank] if services else None
    try:
        gather = full_state if mode != "plain" else _plain_state
        if action == "save":
            model, optimizer = build(mode, world, seed=0)
            train(model, optimizer, int(os.environ.get("CHECKPOINTD_TEST_TRAIN_STEPS", "2")))
            state = gather(model, optimizer)
            save(root, service, model, optimizer, options=options, result=result)
        else:
            model, optimizer = build(mode, world, seed=1)
            targets = {"model": model, "optimizer": optimizer, "progress": {}}
            info = checkpointd.restore(root, targets, storage_options=options, service=service)
            result["source"] = info.source
            state = gather(model, optimizer)
            train(model, optimizer, 1)  # the restored optimizer must work, not only load
        after = gather(model, optimizer)
        result["ok"] = True
        if rank == 0:
            torch.save(state, os.path.join(out, f"{action}.pt"))
            torch.save(after, os.path.join(out, f"{action}_next.pt"))
    except checkpointd.CheckpointError as exc:
        result["error"] = type(exc).__name__
        result["message"] = str(exc)
    _report(out, rank, result)
    if mode != "plain":
        dist.destroy_process_group()


def save(
    root: str,
    service: str | None,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    options: dict[str, Any] | None,
    result: dict[str, Any],
) -> None:
    """Save step 1 (or $CHECKPOINTD_TEST_STEP) with the writer the environment asks for, then train one step: with
    overlapped staging while the save is still copying (the step waits for its copy),
    otherwise once it committed. Records ``blocked`` (seconds ``save()`` blocked)."""
    kwargs: dict[str, Any] = {
        "storage_options": options,
        "incremental": os.environ.get("CHECKPOINTD_TEST_INCREMENTAL") == "1",
        "service": service,
        "staging": os.environ.get("CHECKPOINTD_TEST_STAGING", "blocking"),
        "replicas": int(os.environ.get("CHECKPOINTD_TEST_REPLICAS", "0")),
    }
    state = {"model": model, "optimizer": optimizer, "progress": {"epoch": 3}}
    step = int(os.environ.get("CHECKPOINTD_TEST_STEP", "1"))
    if os.environ.get("CHECKPOINTD_TEST_ASYNC") == "1":

        async def save_async() -> None:
            async with checkpointd.AsyncCheckpointWriter(root, **kwargs) as writer:
                started = time.perf_counter()
                handle = await writer.save(step, state)
                result["blocked"] = time.perf_counter() - started
                await handle.wait()
            train(model, optimizer, 1)

        anyio.run(save_async)
        return
    gate = _hold_copies() if kwargs["staging"] == "overlapped" else None
    with checkpointd.CheckpointWriter(root, **kwargs) as writer:
        started = time.perf_counter()
        handle = writer.save(step, state)
        result["blocked"] = time.perf_counter() - started
        if gate is not None:
            result["staged_at_return"] = handle.staged()
            gate.set()
            train(model, optimizer, 1)
        handle.result()
    if kwargs["staging"] != "overlapped":
        train(model, optimizer, 1)


def _hold_copies() -> threading.Event:
    """Hold every overlapped background copy until the returned event is set (so the
    save is still copying when ``save()`` returns)."""
    gate = threading.Event()
    real = staging.copy_in_background

    def held(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not gate.wait(60):
            raise TimeoutError("the job never opened the gate")
        real(copies)

    staging.copy_in_background = held
    return gate


def _report(out: str, rank: int, result: dict[str, Any]) -> None:
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def refused(root: str, mode: str, world: int, result: dict[str, Any]) -> None:
    """Two saves that must be refused at save(): a sharded model with a writer that saves
    alone, and one inside PerRank. Records each error's class and message."""
    model, _ = build(mode, world, seed=0)
    attempts = {
        "local": (checkpointd.LOCAL, {"model": model}),
        "per_rank": (None, {"model": checkpointd.PerRank(model)}),
    }
    for name, (group, state) in attempts.items():
        try:
            with checkpointd.CheckpointWriter(root, process_group=group) as writer:
                writer.save(1, state).result()
        except checkpointd.CheckpointError as exc:
            result[name] = [type(exc).__name__, str(exc)]
    result["ok"] = True


def _plain_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    # copies: these tensors are the live ones, which the next training step changes
    return copy.deepcopy({"model": model_state, "optimizer": optim_state["state"]})


if __name__ == "__main__":
    main()
