"""One rank of ``benchmarks.bench_peers``'s jobs (run by it, not by hand).

    python -m benchmarks.peers_rank_worker save ROOT0 ROOT1 SOCKETS MB REPS OUT RANK WORLD PORT
    python -m benchmarks.peers_rank_worker restore ROOT0 ROOT1 SOCKETS MB REPS OUT RANK WORLD PORT

Environment: CHECKPOINTD_BENCH_OPTIONS (JSON storage options of both roots, for S3).

``save``: rank_worker's FSDP2 MLP (about MB megabytes of float32 parameters, AdamW's
moments after one step); WARMUP + REPS repetitions, each saving once through this rank's
service (the RANK-th of the comma-separated SOCKETS) to ROOT0 with ``replicas=0`` and to
ROOT1 with ``replicas=1`` (the order alternating), a barrier before each; each save's
``save()`` blocked and time until durable, and the mean time of the training steps run
while it was in flight on any rank (at least one), and of steps with no save. Then one last save of
the same state to both roots (step 1000) and this rank's local shards to
OUT/expected{RANK}.pt. Writes OUT/save{RANK}.json.

``restore``: the same model (other values), a first restore of ROOT0 not measured, then,
each after dropping the roots' page cache and a barrier, ``restore(ROOT1, service=...)`` (a lost node's share is held by a
peer) and ``restore(ROOT0, service=...)`` (nothing replicated: a lost node reads
storage); each one's seconds, ``info.source`` and whether every local shard equals
OUT/expected{RANK}.pt. Writes OUT/restore{RANK}.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import checkpointd
from benchmarks.common import drop_cache
from benchmarks.rank_worker import WIDTH, build, local_tensors

WARMUP = 1


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    started = time.perf_counter()
    model(torch.randn(16, WIDTH)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - started


def _any_in_flight(done: bool) -> bool:
    """True while any rank's save is still in flight (a collective)."""
    flag = torch.tensor([0 if done else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _save(args: list[str], rank: int, world: int, options: Any) -> None:
    root0, root1, sockets, mb, reps, out = args
    socket = sockets.split(",")[rank]
    model, optimizer = build(world, float(mb))
    state = {"model": model, "optimizer": optimizer}
    kwargs: dict[str, Any] = {"keep_last": 1, "service": socket, "storage_options": options}
    writers = {
        "replicas0": checkpointd.CheckpointWriter(root0, replicas=0, **kwargs),
        "replicas1": checkpointd.CheckpointWriter(root1, replicas=1, **kwargs),
    }
    rows: dict[str, list[list[float]]] = {name: [] for name in writers}
    idle = [_step(model, optimizer) for _ in range(3)]
    order = list(writers.items())
    step = 0
    for rep in range(WARMUP + int(reps)):
        for name, writer in order[rep % 2 :] + order[: rep % 2]:
            step += 1
            dist.barrier()
            handle = writer.save(step, state)
            steps = [_step(model, optimizer)]
            while _any_in_flight(handle.done()):  # a step is a collective: every rank agrees
                steps.append(_step(model, optimizer))
            handle.result(600)
            assert handle.durable_seconds is not None
            if rep >= WARMUP:
                rows[name].append(
                    [handle.blocked_seconds, handle.durable_seconds, sum(steps) / len(steps)]
                )
            idle.append(_step(model, optimizer))
    dist.barrier()
    for writer in writers.values():
        writer.save(1000, state).result(600)
    torch.save([t.clone() for t in local_tensors(model, optimizer)], f"{out}/expected{rank}.pt")
    for writer in writers.values():
        writer.close()
    report = {**rows, "idle_step": sorted(idle)[len(idle) // 2]}
    Path(out, f"save{rank}.json").write_text(json.dumps(report))


def _restore(args: list[str], rank: int, world: int, options: Any) -> None:
    root0, root1, sockets, mb, _reps, out = args
    socket = sockets.split(",")[rank]
    model, optimizer = build(world, float(mb))
    state = {"model": model, "optimizer": optimizer}
    expected = torch.load(f"{out}/expected{rank}.pt")
    report: dict[str, Any] = {}
    # a first restore pays for what any first restore of a process does (imports, the
    # store's connections): made of ROOT0, nothing of which the lost node holds after
    checkpointd.restore(root0, state, storage_options=options, service=socket)
    for name, root in (("peer", root1), ("storage", root0)):
        if "://" not in root:
            drop_cache(Path(root))
        dist.barrier()
        started = time.perf_counter()
        info = checkpointd.restore(root, state, storage_options=options, service=socket)
        seconds = time.perf_counter() - started
        got = local_tensors(model, optimizer)
        exact = len(got) == len(expected) and all(
            torch.equal(a, b) for a, b in zip(got, expected, strict=True)
        )
        report[name] = {"seconds": seconds, "source": info.source, "exact": exact}
        for tensor in got:  # the next restore must land every byte again
            tensor.detach().zero_()
    Path(out, f"restore{rank}.json").write_text(json.dumps(report))


def main() -> None:
    action, *args = sys.argv[1:]
    rank, world, port = int(args[-3]), int(args[-2]), args[-1]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    options = json.loads(os.environ.get("CHECKPOINTD_BENCH_OPTIONS", "null"))
    if action == "save":
        _save(args[:-3], rank, world, options)
    else:
        _restore(args[:-3], rank, world, options)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
