"""One rank of ``benchmarks.bench_incremental``'s ``lora-ranks`` case (run by it, not by hand).

    python -m benchmarks.incremental_rank_worker BASE_MB ADAPTER_MB SAVES FOLDER OUT RANK WORLD PORT

Builds layers of a frozen 1024x1024 float32 base weight (about BASE_MB MB in all)
with LoRA adapters (about ADAPTER_MB MB) and shards them with FSDP2 over the WORLD
gloo ranks; AdamW trains the adapters. Per save: one training step, then a full
writer and an ``incremental=True`` writer (both ``keep_last=2``, under FOLDER) save
the step, alternating who goes first. Writes OUT/rankR.json: the bytes the step
changed (adapters and their AdamW state, whole) and per save and writer the bytes
written, the bytes referenced and the durable seconds.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import checkpointd

WIDTH = 1024
MB = 10**6


class LoraLinear(torch.nn.Module):
    """A frozen linear layer plus a trainable low-rank update ``b @ a``."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.base = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.base.weight.requires_grad_(False)
        self.a = torch.nn.Parameter(torch.randn(rank, WIDTH) / WIDTH)
        self.b = torch.nn.Parameter(torch.randn(WIDTH, rank) / WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.T) @ self.b.T


def build(world: int, base_mb: float, adapter_mb: float) -> tuple[Any, Any]:
    layers = max(1, round(base_mb * MB / (4 * WIDTH * WIDTH)))
    rank = max(1, round(adapter_mb * MB / (layers * 2 * 4 * WIDTH)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(LoraLinear(rank) for _ in range(layers)))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=1e-3)


def changed_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes a training step changes: the adapters and every AdamW state tensor, whole
    (a DTensor's ``numel`` is its global one)."""
    total = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            total += param.numel() * param.element_size()
            for value in optimizer.state[param].values():
                if isinstance(value, torch.Tensor):
                    total += value.numel() * value.element_size()
    return total


def main() -> None:
    base_mb, adapter_mb, saves, folder, out, rank_s, world_s, port = sys.argv[1:]
    rank, world = int(rank_s), int(world_s)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    model, optimizer = build(world, float(base_mb), float(adapter_mb))
    writers = {
        kind: checkpointd.CheckpointWriter(
            os.path.join(folder, kind), keep_last=2, incremental=kind == "incremental"
        )
        for kind in ("full", "incremental")
    }
    rows: dict[str, list[dict[str, float]]] = {kind: [] for kind in writers}
    changed = 0
    try:
        for step in range(1, int(saves) + 1):
            batch = torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(step))
            model(batch).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            changed = changed_bytes(optimizer)
            order = list(writers.items())
            for kind, writer in order if step % 2 else order[::-1]:
                dist.barrier()
                started = time.perf_counter()
                info = writer.save(step, {"model": model, "optimizer": optimizer}).result()
                rows[kind].append(
                    {
                        "step": step,
                        "written": info.written_nbytes,
                        "referenced": info.referenced_nbytes,
                        "durable_s": time.perf_counter() - started,
                    }
                )
    finally:
        for writer in writers.values():
            writer.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"changed_bytes_per_save": changed, "rows": rows}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
