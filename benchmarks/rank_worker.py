"""One rank of ``benchmarks.bench_ranks`` (run by it, not by hand).

    python -m benchmarks.rank_worker SAVE_WORLD MB REPS FOLDER OUT RANK WORLD PORT

Builds an FSDP2 MLP with about MB megabytes of float32 parameters (AdamW state
makes the whole state three times that), trains one step so the optimizer has
state, then per repetition, in rotation and with a barrier between methods:
``memcpy`` (a copy of this rank's own shards into a preallocated buffer: the
floor for a blocking snapshot), ``checkpointd`` (save: blocked, durable),
``dcp_thread`` and ``dcp_process`` (torch.distributed.checkpoint.async_save in
thread and process mode: blocked, durable); then restore from the newest of
each (checkpointd.restore vs dcp.load + set_state_dict). With WORLD !=
SAVE_WORLD it only restores (resharding), from checkpoints saved by SAVE_WORLD
ranks. Writes OUT/rankR.json: seconds per method and measure.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import checkpointd

WIDTH = 1024


def build(world: int, mb: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    layers = max(1, round(mb * 2**20 / (4 * WIDTH * (WIDTH + 1))))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, WIDTH)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def local_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's own shards: parameters and optimizer state."""
    found = [p.to_local() for p in model.parameters()]  # type: ignore[operator]
    for state in optimizer.state.values():
        found += [v.to_local() if hasattr(v, "to_local") else v for v in state.values()]
    return [t for t in found if isinstance(t, torch.Tensor)]


Record = Callable[[str, float], None]


def save_all(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, reps: int, folder: str, record: Record
) -> None:
    """Each repetition: memcpy floor, checkpointd save, DCP async_save thread and process."""
    shards = local_tensors(model, optimizer)
    arena = torch.empty(sum(t.numel() * t.element_size() for t in shards), dtype=torch.uint8)
    root = os.path.join(folder, "checkpointd")
    with checkpointd.CheckpointWriter(root, keep_last=1) as writer:
        for step in range(reps):
            dist.barrier()
            started = time.perf_counter()
            at = 0
            for t in shards:
                n = t.numel() * t.element_size()
                arena[at : at + n].view(t.dtype).view(t.shape).copy_(t)
                at += n
            record("memcpy.blocked", time.perf_counter() - started)
            dist.barrier()
            started = time.perf_counter()
            handle = writer.save(step, {"model": model, "optimizer": optimizer})
            record("checkpointd.blocked", time.perf_counter() - started)
            handle.result()
            record("checkpointd.durable", time.perf_counter() - started)
            for kind in ("thread", "process"):
                dist.barrier()
                path = os.path.join(folder, "dcp", kind, str(step))
                started = time.perf_counter()
                model_state, optim_state = get_state_dict(model, optimizer)
                future = dcp.async_save(
                    {"model": model_state, "optimizer": optim_state},
                    checkpoint_id=path,
                    async_checkpointer_type=dcp.state_dict_saver.AsyncCheckpointerType(kind),
                )
                record(f"dcp_{kind}.blocked", time.perf_counter() - started)
                (future if hasattr(future, "result") else future.upload_completion).result()
                record(f"dcp_{kind}.durable", time.perf_counter() - started)


def restore_all(world: int, mb: float, reps: int, folder: str, record: Record) -> None:
    """Each repetition: a fresh model restored by checkpointd, then one by dcp.load."""
    dcp_folder = os.path.join(folder, "dcp", "thread")
    newest = os.path.join(dcp_folder, max(os.listdir(dcp_folder), key=int))
    for _ in range(reps):
        dist.barrier()
        model, optimizer = build(world, mb)
        dist.barrier()
        started = time.perf_counter()
        checkpointd.restore(
            os.path.join(folder, "checkpointd"), {"model": model, "optimizer": optimizer}
        )
        record("checkpointd.read.restore", time.perf_counter() - started)
        dist.barrier()
        model, optimizer = build(world, mb)
        dist.barrier()
        started = time.perf_counter()
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=newest)
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
        record("dcp.restore", time.perf_counter() - started)


def main() -> None:
    save_world, mb, reps, folder, out, rank_s, world_s, port = sys.argv[1:]
    rank, world = int(rank_s), int(world_s)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    seconds: dict[str, list[float]] = {}

    def record(key: str, value: float) -> None:
        seconds.setdefault(key, []).append(value)

    if world == int(save_world):
        model, optimizer = build(world, float(mb))
        save_all(model, optimizer, int(reps), folder, record)
        del model, optimizer
    restore_all(world, float(mb), int(reps), folder, record)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(seconds, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
