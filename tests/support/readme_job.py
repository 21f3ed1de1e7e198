"""One rank of the FSDP2 example of docs/ranks.md ("Many ranks"), run as a subprocess.

    python -m tests.support.readme_job ACTION ROOT OUT STRICT RANK WORLD PORT

The example's exact pattern: one ``state`` dict (an FSDP2 model, its AdamW,
``RNGState()`` and ``PerRank(sampler)`` of a ``DistributedSampler``) given to
``restore`` on resume and to ``writer.save``. ACTION ``save`` trains two steps and
saves step 1; ``restore`` builds everything afresh (other seeds) and restores with
``strict=(STRICT == "strict")``. Rank 0 writes OUT/{ACTION}.pt (the full model and
optimizer state, gathered by torch.distributed.checkpoint); every rank writes
OUT/rank{RANK}.json: ``ok``, ``error``, ``message``, ``rand`` (three draws of torch's
generator right after the save or restore), the sampler's ``epoch`` and ``seed``,
``restored``, ``skipped_targets`` and ``warnings`` (what the checkpointd logger said).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler

import checkpointd
from tests.support.shard_job import build, full_state, train


class _Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main() -> None:
    action, root, out, strict, rank_s, world_s, port = sys.argv[1:]
    rank, world = int(rank_s), int(world_s)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    recorder = _Recorder()
    logging.getLogger("checkpointd").addHandler(recorder)
    result: dict[str, Any] = {"ok": False, "error": None, "message": ""}
    saving = action == "save"
    model, optimizer = build("fsdp2", world, seed=0 if saving else 1)
    sampler = DistributedSampler(TensorDataset(torch.arange(40)), seed=5 if saving else 0)
    state = {
        "model": model,
        "optimizer": optimizer,
        "rng": checkpointd.RNGState(),  # per rank by itself
        "loader": checkpointd.PerRank(sampler),  # differs by rank
    }
    try:
        if saving:
            train(model, optimizer, 2)
            sampler.set_epoch(3)
            torch.manual_seed(100 + rank)  # each rank's generator differs
            with checkpointd.CheckpointWriter(root) as writer:
                writer.save(1, state)
                writer.wait()
        else:
            torch.manual_seed(999)
            assert checkpointd.list_checkpoints(root)
            info = checkpointd.restore(root, state, strict=strict == "strict")
            result["restored"] = list(info.restored)
            result["skipped_targets"] = list(info.skipped_targets)
        result["rand"] = torch.rand(3).tolist()
        result["epoch"], result["seed"] = sampler.epoch, sampler.seed
        gathered = full_state(model, optimizer)
        if rank == 0:
            torch.save(gathered, os.path.join(out, f"{action}.pt"))
        result["ok"] = True
    except checkpointd.CheckpointError as exc:
        result["error"] = type(exc).__name__
        result["message"] = str(exc)
    result["warnings"] = recorder.messages
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
