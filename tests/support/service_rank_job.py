"""One rank of a gloo job that saves through its node's checkpoint service.

    python -m tests.support.service_rank_job SCENARIO SOCKET ROOT OUT STEPS RANK WORLD PORT

The job's TCP store is hosted by the test (as torchrun's agent hosts it), at
127.0.0.1:PORT; this rank connects to it and to the service at SOCKET. Scenarios:

- ``save``: save steps 1..STEPS, printing ``returned N`` (flushed) after each
  ``save()`` returned, then wait and write OUT/rank{RANK}.json with each handle's
  outcome (the test may kill -9 the ranks right after the last ``returned``).
- ``absent``: rank 0 saves step 1 and reports its outcome; rank 1 makes its writer,
  then exits without saving (its writer closed by a process exit, no ``save()``).
- ``stage`` (3 ranks): ranks {1, 2} save as ``save`` does with ``process_group=`` a
  ``new_group([1, 2])``; rank 0 makes no writer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import checkpointd
from tests.support.launch import join_hosted_store


def rank_state(step: int, rank: int) -> dict[str, Any]:
    """Replicated weights (the same on every rank) and a per-rank counter."""
    generator = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(1024, 1024, generator=generator), "step": step},
        "mine": checkpointd.PerRank({"rank": rank, "step": step}),
    }


def main() -> None:
    scenario, socket, root, out, steps_s, rank_s, world_s, port = sys.argv[1:]
    rank, world, steps = int(rank_s), int(world_s), int(steps_s)
    join_hosted_store(int(port), rank, world)
    result: dict[str, Any] = {"outcomes": []}
    group = None
    if scenario == "stage":  # ranks {1, 2} of 3 save; rank 0 only trains
        group = dist.new_group([1, 2])
        if rank == 0:
            dist.barrier()  # after the stage's saves resolved
            Path(out, "rank0.json").write_text(json.dumps(result))
            dist.destroy_process_group()
            return
    with checkpointd.CheckpointWriter(
        root, service=socket, max_pending=steps, process_group=group
    ) as writer:
        if scenario == "absent" and rank == 1:
            dist.barrier()  # rank 0's writer exists too
            return
        if scenario == "absent":
            dist.barrier()
        handles = []
        for step in range(1, steps + 1):
            handles.append(writer.save(step, rank_state(step, rank)))
            print(f"returned {step}", flush=True)
        for handle in handles:
            try:
                info = handle.result(120)
                result["outcomes"].append(["committed", info.step])
            except checkpointd.CheckpointError as exc:
                result["outcomes"].append([type(exc).__name__, str(exc)])
    if scenario == "stage":
        dist.barrier()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
