"""One rank of a 2-rank FSDP2 job that saves through its node's checkpoint service.

    python -m tests.support.service_fsdp_job SOCKET ROOT OUT STEPS RANK WORLD PORT

The job's TCP store is hosted by the test (as torchrun's agent hosts it) at
127.0.0.1:PORT. For each step 1..STEPS: one training step of shard_job's FSDP2 MLP,
rank 0 writes the whole state (gathered by torch.distributed.checkpoint.state_dict)
to OUT/expected{step}.pt, then every rank saves through the service at SOCKET and
prints ``returned N`` (flushed) once ``save()`` returned. Then it waits for its
handles (the test may kill -9 it before).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import checkpointd
from tests.support.launch import join_hosted_store
from tests.support.shard_job import build, full_state, train


def main() -> None:
    socket, root, out, steps_s, rank_s, world_s, port = sys.argv[1:]
    rank, world, steps = int(rank_s), int(world_s), int(steps_s)
    join_hosted_store(int(port), rank, world)
    model, optimizer = build("fsdp2", world, seed=0)
    with checkpointd.CheckpointWriter(root, service=socket, max_pending=steps) as writer:
        handles = []
        for step in range(1, steps + 1):
            train(model, optimizer, 1)
            expected = full_state(model, optimizer)  # a collective: every rank gathers
            if rank == 0:
                torch.save(expected, os.path.join(out, f"expected{step}.pt"))
            dist.barrier()  # rank 0's file is written before any rank reports
            state = {"model": model, "optimizer": optimizer, "progress": {"epoch": 3}}
            handles.append(writer.save(step, state))  # shard_job's components
            print(f"returned {step}", flush=True)
        for handle in handles:
            handle.result(120)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
