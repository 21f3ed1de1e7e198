"""One rank of a job whose checkpoints a sub-group saves, run as a subprocess.

    python -m tests.support.group_job SCENARIO ROOT OUT RANK WORLD PORT

Joins a gloo group of WORLD ranks (rank 0 hosts the TCP store) and plays SCENARIO:

- ``stage`` (3 ranks): ranks {1, 2} are a pipeline stage (``new_group``): an FSDP2
  model on that group's mesh, saved with ``process_group=`` the stage, with a
  ``PerRank`` and an ``RNGState``, while every rank (rank 0 too) runs world
  all-reduces; rank 0 makes no writer of the stage's root (its own writer is
  ``LOCAL``, on ROOT-rank0) and is refused one for the stage. Then the stage
  restores into a model of another seed with ``process_group=`` the stage.
  The stage's group rank 0 writes OUT/save.pt (the saved state, gathered by
  torch.distributed.checkpoint.state_dict).
- ``reshard`` (any world): FSDP2 on the whole world restores ROOT (strict=False: the
  per-rank state of another world is skipped); rank 0 writes OUT/restore.pt.
- ``pairs`` (4 ranks): groups {0, 1} and {2, 3} save their own roots (ROOT/a, ROOT/b)
  at the same time through the one job store, steps 1-3, with world all-reduces
  between saves; at step 2 rank 3 refuses its save (an unstorable value), so {2, 3}
  fail that step while {0, 1} commit it. Then each group watches preemption: rank 1
  gets SIGTERM at step 6, rank 3 at step 8 (``stopped_at``: where its group saved).

Each rank writes OUT/rank{RANK}.json (``ok``, ``error``, ``message``, and the scenario's
findings).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import checkpointd
from checkpointd import tunables
from tests.faults.helpers import same
from tests.support.rank_job import Position
from tests.support.shard_job import DIMS, full_state, train


def fsdp2(mesh: Any, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """shard_job's MLP, fully sharded on ``mesh``, and an AdamW over it."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(DIMS[0], DIMS[1]), torch.nn.ReLU(), torch.nn.Linear(DIMS[1], DIMS[2])
    )
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def all_reduces(count: int) -> float:
    """``count`` all-reduces on the whole world (the training's own collectives)."""
    total = torch.zeros(1)
    for _ in range(count):
        value = torch.ones(1)
        dist.all_reduce(value)
        total += value
    return float(total)


def stage(root: str, out: str, rank: int, result: dict[str, Any]) -> None:
    group = dist.new_group([1, 2])
    if rank == 0:
        try:
            checkpointd.CheckpointWriter(root, process_group=group)
        except checkpointd.CheckpointError as exc:
            result["refused"] = [type(exc).__name__, str(exc)]
        with checkpointd.CheckpointWriter(f"{root}-rank0", process_group=checkpointd.LOCAL) as w:
            w.save(5, {"mine": torch.arange(3)}).result()
        result["sum"] = all_reduces(20)
        result["ok"] = True
        return
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(group, "cpu")
    model, optimizer = fsdp2(mesh, seed=0)
    train(model, optimizer, 2)
    saved = full_state(model, optimizer)  # a collective of the stage only
    torch.manual_seed(1000 + rank)  # each rank's generator differs
    state = {
        "model": model,
        "optimizer": optimizer,
        "progress": {"epoch": 3},
        "loader": checkpointd.PerRank(Position(10 * rank + 7)),
        "rng": checkpointd.RNGState(),
    }
    with checkpointd.CheckpointWriter(root, process_group=group) as writer:
        handle = writer.save(1, state)
        after_save = torch.rand(3)
        result["sum"] = all_reduces(20)  # with rank 0, while the save is in flight
        info = handle.result()
    result["step"] = info.step
    if dist.get_rank(group) == 0:
        torch.save(saved, os.path.join(out, "save.pt"))
    # restored into another model, on the stage's ranks; the other ranks' state skipped
    fresh, fresh_optimizer = fsdp2(mesh, seed=1)
    position = Position(-1)
    targets = {
        "model": fresh,
        "optimizer": fresh_optimizer,
        "progress": {},
        "loader": position,
        "rng": checkpointd.RNGState(),
    }
    try:  # the default group has 3 ranks: this rank's per-rank state is not told apart
        checkpointd.restore(root, targets)
    except checkpointd.RestoreMismatchError as exc:
        result["without_group"] = str(exc)
    torch.rand(5)  # move the generator on
    checkpointd.restore(root, targets, process_group=group)
    result["exact"] = same(saved, full_state(fresh, fresh_optimizer))
    result["loader"] = position.pos
    result["rng_exact"] = torch.equal(torch.rand(3), after_save)
    result["progress"] = targets["progress"]
    result["ok"] = True


def reshard(root: str, out: str, rank: int, world: int, result: dict[str, Any]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    model, optimizer = fsdp2(init_device_mesh("cpu", (world,)), seed=1)
    targets = {"model": model, "optimizer": optimizer, "progress": {}}
    checkpointd.restore(root, targets, strict=False)
    restored = full_state(model, optimizer)
    if rank == 0:
        torch.save(restored, os.path.join(out, "restore.pt"))
    result["ok"] = True


def pairs(root: str, rank: int, result: dict[str, Any]) -> None:
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both
    mine = rank // 2
    torch.manual_seed(mine)
    model = torch.nn.Linear(32, 16)
    result["steps"] = {}
    with checkpointd.CheckpointWriter(f"{root}/{'ab'[mine]}", process_group=groups[mine]) as w:
        for step in (1, 2, 3):
            state: dict[str, Any] = {"model": model, "extra": {"group": mine, "step": step}}
            if (rank, step) == (3, 2):
                state["extra"]["bad"] = object()  # refused at save()
            started = time.monotonic()
            try:
                w.save(step, state).result()
                outcome = ["ok", ""]
            except checkpointd.CheckpointError as exc:
                outcome = [type(exc).__name__, str(exc)]
            result["steps"][step] = [*outcome, time.monotonic() - started]
            all_reduces(5)  # the world's collectives between saves
        # each group agrees on preemption by itself: rank 1 is signalled at step 6, rank 3
        # at step 8, and each group stops where its own rank was
        w.watch_preemption()
        for step in range(4, 100):
            if (rank, step) in {(1, 6), (3, 8)}:
                os.kill(os.getpid(), signal.SIGTERM)
            if w.save_if_preempted(step, {"model": model, "extra": {"group": mine, "step": step}}):
                result["stopped_at"] = step
                break
    result["ok"] = True


def main() -> None:
    scenario, root, out, rank_s, world_s, port = sys.argv[1:]
    rank, world = int(rank_s), int(world_s)
    tunables.HEARTBEAT_SECONDS = 0.2
    tunables.STALE_SECONDS = 5.0
    tunables.JOIN_SECONDS = 30.0  # a refused save must fail its peers long before this
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    result: dict[str, Any] = {"ok": False, "error": None, "message": ""}
    try:
        if scenario == "stage":
            stage(root, out, rank, result)
        elif scenario == "reshard":
            reshard(root, out, rank, world, result)
        else:
            pairs(root, rank, result)
    except checkpointd.CheckpointError as exc:
        result["error"] = type(exc).__name__
        result["message"] = str(exc)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
