"""One rank of a job that saves with ``staging="overlapped"`` while it trains on.

    python -m tests.support.overlap_job SCENARIO ROOT OUT RANK WORLD PORT

The state: shard_job's MLP under FSDP2 (a 1-D mesh of every rank) with AdamW, and a
DDP model (replicated: every rank holds the same values) with SGD and momentum,
each trained two steps. The background copy is held (``staging.copy_in_background``
waits for a gate) so the save is provably still staging while training goes on.

- ``train``: save step 1; while its copy is held, a forward and backward of both
  models (FSDP2 all-gathers and reduce-scatters, DDP all-reduces); then the gate
  opens, the optimizers step (their pre-hooks wait for the copy) and two more steps
  run; the save commits; fresh models restore it. Reports ``staged_at_return``,
  ``held_bytes`` (bytes copied in the background), ``guarded_bytes`` (this rank's
  bytes of the optimizers' parameters and state), ``moved_on`` (the live state
  differs from the saved one by then) and ``exact`` (restored == saved, bit for bit).
- ``fail``: rank 1's background copy raises; both ranks report step 1's error and
  how long it took (``seconds``), then (the copy fixed) save step 2 (``retry``).

Each rank writes OUT/rank{RANK}.json.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

import checkpointd
from checkpointd import tunables
from checkpointd.write import staging
from tests.faults.helpers import same
from tests.support.shard_job import DIMS, full_state
from tests.support.shard_job import build as build_fsdp2


def build(world: int, seed: int) -> dict[str, Any]:
    """The two models and their optimizers, from ``seed``."""
    model, optimizer = build_fsdp2("fsdp2", world, seed)
    torch.manual_seed(seed + 100)
    replicated = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(DIMS[0], 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    )
    sgd = torch.optim.SGD(replicated.parameters(), lr=0.05, momentum=0.9)
    return {"fsdp": model, "adamw": optimizer, "ddp": replicated, "sgd": sgd}


def backward(state: dict[str, Any], generator: torch.Generator) -> None:
    """Forward and backward of both models on one batch (collectives, no step)."""
    batch = torch.randn(8, DIMS[0], generator=generator)
    state["fsdp"](batch).square().mean().backward()
    state["ddp"](batch).square().mean().backward()


def step(state: dict[str, Any]) -> None:
    for name in ("adamw", "sgd"):
        state[name].step()
        state[name].zero_grad()


def gathered(state: dict[str, Any]) -> dict[str, Any]:
    """Both models' and optimizers' state with whole tensors (collectives)."""
    return {
        "fsdp": full_state(state["fsdp"], state["adamw"]),
        "ddp": full_state(state["ddp"], state["sgd"]),
    }


def hold_copies(gate: threading.Event, result: dict[str, Any], fail: bool) -> None:
    """Make the copier thread wait for ``gate`` (or raise, with ``fail``) first."""
    original = staging.copy_in_background
    result["held_bytes"] = 0

    def held(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        result["held_bytes"] += sum(source.nbytes for source, _ in copies)
        if fail:
            raise RuntimeError("injected: the background copy failed")
        if not gate.wait(60):
            raise RuntimeError("the gate never opened")
        original(copies)

    staging.copy_in_background = held  # type: ignore[assignment]
    result["restore_copier"] = original


def guarded_bytes(state: dict[str, Any]) -> int:
    """This rank's bytes of the optimizers' parameters and state tensors (local shards)."""
    tensors = []
    for name in ("adamw", "sgd"):
        optimizer = state[name]
        tensors += [p for group in optimizer.param_groups for p in group["params"]]
        tensors += [v for s in optimizer.state.values() for v in s.values()]
    return sum(getattr(t, "_local_tensor", t).nbytes for t in tensors)


def train(root: str, world: int, state: dict[str, Any], result: dict[str, Any]) -> None:
    generator = torch.Generator().manual_seed(11)
    saved = gathered(state)
    result["guarded_bytes"] = guarded_bytes(state)
    gate = threading.Event()
    hold_copies(gate, result, fail=False)
    with checkpointd.CheckpointWriter(root, staging="overlapped") as writer:
        handle = writer.save(1, state)
        result["staged_at_return"] = handle.staged()
        backward(state, generator)  # training goes on while the copy is held
        result["staged_after_backward"] = handle.staged()
        gate.set()
        step(state)  # waits for the copy (the optimizers' pre-hooks)
        for _ in range(2):
            backward(state, generator)
            step(state)
        handle.result()
    result["moved_on"] = not same(saved, gathered(state))
    fresh = build(world, seed=1)
    checkpointd.restore(root, fresh)
    result["exact"] = same(saved, gathered(fresh))


def fail(root: str, rank: int, state: dict[str, Any], result: dict[str, Any]) -> None:
    generator = torch.Generator().manual_seed(11)
    if rank == 1:
        hold_copies(threading.Event(), result, fail=True)
    with checkpointd.CheckpointWriter(root, staging="overlapped") as writer:
        started = time.monotonic()
        handle = writer.save(1, state)
        backward(state, generator)
        try:
            handle.result()
        except checkpointd.CheckpointError as exc:
            result["error"] = type(exc).__name__
            result["message"] = str(exc)
        result["seconds"] = time.monotonic() - started
        result["published"] = [info.step for info in writer.list_checkpoints()]
        step(state)
        if rank == 1:
            staging.copy_in_background = result["restore_copier"]
        result["retry"] = writer.save(2, state).result().step
    result["ok"] = True


def main() -> None:
    scenario, root, out, rank_s, world_s, port = sys.argv[1:]
    rank, world = int(rank_s), int(world_s)
    tunables.HEARTBEAT_SECONDS = 0.2
    tunables.STALE_SECONDS = 5.0
    tunables.JOIN_SECONDS = 30.0  # a failed copy must fail the other rank long before this
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    result: dict[str, Any] = {"ok": False, "error": None, "message": ""}
    state = build(world, seed=0)
    generator = torch.Generator().manual_seed(3)
    for _ in range(2):
        backward(state, generator)
        step(state)
    try:
        if scenario == "train":
            train(root, world, state, result)
            result["ok"] = True
        else:
            fail(root, rank, state, result)
    except checkpointd.CheckpointError as exc:
        result["error"] = type(exc).__name__
        result["message"] = str(exc)
    result.pop("restore_copier", None)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
