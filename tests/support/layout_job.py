"""One rank of a 2-rank FSDP2 job whose layout changes between saves of one writer.

    python -m tests.support.layout_job ROOT OUT RANK WORLD PORT

A writer keeps what does not change between saves of the same layout (the optimizer's
parameter names, the shard layouts, the staging arena's views); this job changes the
layout under it, saving after each change with the same writer:

1. the FSDP2 MLP (layers 0-2 trained by AdamW, layer 3 not in the optimizer yet), and
   a plain component ``t`` with a DTensor placed Shard(0);
2. the same layout, after another training step (what is kept is used);
3. layers 0 and 1 swapped in the model: the same parameters, other names;
4. layer 3's parameters added to the optimizer as a second group, one step taken:
   more parameters, more bytes (a larger staging arena);
5. one optimizer state tensor made float64 at the same name, and ``t`` placed Shard(1)
   (same global shape, other local shards and offsets).

After each save, rank 0 writes OUT/expected{STEP}.pt: the whole state as DCP's
``get_state_dict(full_state_dict=True)`` gathers it then (model and optimizer by
parameter name) and ``t`` gathered. OUT/rankR.json: ``ok``, ``error``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

import checkpointd

WIDTH = 48  # a layer's AdamW state is more than a few 4 KiB regions: adding it grows the arena


def build(mesh: Any) -> tuple[torch.nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW([p for layer in model[:3] for p in layer.parameters()], lr=0.1)
    return model, optimizer


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    model(torch.randn(4, WIDTH, generator=generator)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def expected(model: torch.nn.Module, optimizer: torch.optim.Optimizer, t: Any) -> dict[str, Any]:
    """The whole state as DCP gathers it (every rank takes part)."""
    options = StateDictOptions(full_state_dict=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    return {"model": model_state, "optimizer": optim_state, "t": {"x": t.full_tensor()}}


def main() -> None:
    root, out, rank_s, world_s, port = sys.argv[1:]
    rank, world = int(rank_s), int(world_s)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    result: dict[str, Any] = {"ok": False, "error": None}
    try:
        mesh = init_device_mesh("cpu", (world,))
        model, optimizer = build(mesh)
        full_t = torch.arange(6.0 * WIDTH).reshape(6, WIDTH)
        t = distribute_tensor(full_t, mesh, [Shard(0)])
        train(model, optimizer, 1)
        with checkpointd.CheckpointWriter(root) as writer:
            for step in range(1, 6):
                if step == 2:
                    train(model, optimizer, 2)
                elif step == 3:
                    model[0], model[1] = model[1], model[0]
                elif step == 4:
                    optimizer.add_param_group({"params": list(model[3].parameters())})
                    for p in model[3].parameters():
                        p.grad = torch.ones_like(p)
                    optimizer.step()
                    optimizer.zero_grad()
                elif step == 5:
                    state = optimizer.state[model[2].weight]
                    state["exp_avg"] = state["exp_avg"].to(torch.float64)
                    t = distribute_tensor(full_t, mesh, [Shard(1)])
                state_now = {"model": model, "optimizer": optimizer, "t": {"x": t}}
                writer.save(step, state_now).result()
                whole = expected(model, optimizer, t)
                if rank == 0:
                    torch.save(whole, os.path.join(out, f"expected{step}.pt"))
        result["ok"] = True
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
