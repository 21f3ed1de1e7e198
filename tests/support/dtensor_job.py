"""One rank of a job that saves odd DTensors and restores them under other placements.

    python -m tests.support.dtensor_job ACTION ROOT OUT RANK WORLD PORT

``save`` distributes the tensors of ``full_state()`` with the SAVED placements (a
2-row tensor over 3 ranks leaves one rank an empty shard; Shard(1); bool; bfloat16;
a replicated scalar) in a plain dict component, plus one DTensor as a component of
its own; ``restore`` makes zero DTensors with the RESTORED placements, restores into
them and checks each is still a DTensor so placed and, gathered, equals ``full_state()``. OUT/rankR.json: ``ok``,
``equal`` (name -> bool), ``error``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import checkpointd

SAVED = {
    "tiny": Shard(0),
    "col": Shard(1),
    "flag": Shard(0),
    "scalar": Replicate(),
    "big": Shard(0),
}
RESTORED = {
    "tiny": Shard(1),
    "col": Shard(0),
    "flag": Replicate(),
    "scalar": Replicate(),
    "big": Shard(1),
}


def full_state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "tiny": torch.arange(10.0).reshape(2, 5),
        "col": torch.randn(4, 7, generator=generator),
        "flag": torch.rand(5, 3, generator=generator) > 0.5,
        "scalar": torch.tensor(3.5),
        "big": torch.randn(33, 4, generator=generator).to(torch.bfloat16),
    }


def main() -> None:
    action, root, out, rank_s, world_s, port = sys.argv[1:]
    rank, world = int(rank_s), int(world_s)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    mesh = init_device_mesh("cpu", (world,))
    full = full_state()
    result: dict[str, Any] = {"ok": False, "error": None, "equal": {}}
    try:
        if action == "save":
            tensors = {k: distribute_tensor(v, mesh, [SAVED[k]]) for k, v in full.items()}
            whole = distribute_tensor(full["col"], mesh, [Shard(0)])
            with checkpointd.CheckpointWriter(root) as writer:
                writer.save(1, {"t": tensors, "whole": whole}).result()
        else:
            tensors = {
                k: distribute_tensor(torch.zeros_like(v), mesh, [RESTORED[k]])
                for k, v in full.items()
            }
            whole = distribute_tensor(torch.zeros(4, 7), mesh, [Shard(1)])
            checkpointd.restore(root, {"t": tensors, "whole": whole})
            for name, value in tensors.items():
                # still a DTensor placed as the target was, not a whole tensor in its stead
                placed = isinstance(value, DTensor) and tuple(value.placements) == (RESTORED[name],)
                result["equal"][name] = placed and torch.equal(value.full_tensor(), full[name])
            result["equal"]["whole"] = torch.equal(whole.full_tensor(), full["col"])
        result["ok"] = True
    except checkpointd.CheckpointError as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
