"""One rank of a small multi-rank job for the many-ranks tests, run as a subprocess.

    python -m tests.support.rank_job SCENARIO ROOT OUT STEP RANK WORLD PORT

Joins a gloo group through a TCP store on 127.0.0.1:PORT (rank 0 hosts it), makes a CheckpointWriter on the default
group and plays SCENARIO (see ``SCENARIOS``); writes what happened on this rank
to OUT/rank{RANK}.json: ``ok``, ``error`` (the class name), ``message``, ``seconds``
(from the save call until the handle resolved).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import checkpointd
from checkpointd import tunables
from checkpointd.write import commit
from checkpointd.write import ranked_commit as rankcommit

SCENARIOS = (
    "replicated",
    "mismatch",
    "full_disk",
    "killed",
    "killed0",
    "killed0_publishing",
    "rank0_only",
    "preempted",
)


def replicated_state(rank: int, scenario: str) -> dict[str, Any]:
    """The same model and optimizer state on every rank (rank-specific where the scenario
    wants replicas to differ)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    extra = {"table": torch.arange(4096, dtype=torch.float32), "epoch": 3}
    if scenario == "mismatch":
        extra["table"][rank] = -1.0
    return {"model": model, "optimizer": optimizer, "extra": extra}


class Position:
    """A per-rank component: where this rank's data stream is."""

    def __init__(self, pos: int) -> None:
        self.pos = pos

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pos = int(state["pos"])


def _restore_per_rank(
    root: str, rank: int, result: dict[str, Any], after_save: torch.Tensor
) -> None:
    """Restore this rank's Position and RNG state; report what came back."""
    torch.rand(5)  # move the generator on
    position = Position(-1)
    checkpointd.restore(root, {"loader": position, "rng": checkpointd.RNGState()}, strict=False)
    result["loader"] = position.pos
    result["rng_exact"] = torch.equal(torch.rand(3), after_save)


def _preempted(root: str, rank: int, state: dict[str, Any], result: dict[str, Any]) -> None:
    """A training loop that watches SIGTERM; rank 1 alone gets one (a real signal, from
    itself) at step 5, and the ranks must agree to save that step and stop."""
    with checkpointd.CheckpointWriter(root) as writer:
        writer.watch_preemption()
        for step in range(1, 1000):
            state["extra"]["epoch"] = step
            if rank == 1 and step == 5:
                os.kill(os.getpid(), signal.SIGTERM)
            if writer.save_if_preempted(step, state):
                result["ok"] = True
                result["stopped_at"] = step
                result["signalled"] = writer.preempted
                return


def _die_while_writing(*args: Any) -> Any:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    scenario, root, out, step_s, rank_s, world_s, port = sys.argv[1:]
    rank, world, step = int(rank_s), int(world_s), int(step_s)
    tunables.HEARTBEAT_SECONDS = 0.2
    tunables.STALE_SECONDS = 3.0  # short, yet above scheduling stalls of a loaded 2-core box
    tunables.JOIN_SECONDS = 3.0
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    result: dict[str, Any] = {"ok": False, "error": None, "message": "", "seconds": 0.0}
    state = replicated_state(rank, scenario)
    if scenario == "full_disk" and rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.RLIM_INFINITY))
    if (scenario, rank) in {("killed", 1), ("killed0", 0)}:
        commit._stream_file = _die_while_writing  # type: ignore[assignment]  # noqa: SLF001 - fault: die while a file streams
    if (scenario, rank) == ("killed0_publishing", 0):
        # every rank's files are durable; rank 1 waits for the outcome
        rankcommit.publish_manifest = _die_while_writing  # type: ignore[assignment]
    if scenario == "replicated":
        state["loader"] = checkpointd.PerRank(Position(10 * rank + 7))
        state["rng"] = checkpointd.RNGState()
        torch.manual_seed(1000 + rank)  # each rank's generator differs
    started = time.monotonic()
    if scenario == "preempted":
        _preempted(root, rank, state, result)
        _report(out, rank, result, started)
        dist.destroy_process_group()
        return
    try:
        with checkpointd.CheckpointWriter(root) as writer:
            assert writer.world_size == world, writer.world_size  # every rank saves together
            if scenario != "rank0_only" or rank == 0:
                info = writer.save(step, state).result()
                result["info"] = [info.step, info.nbytes, list(info.components), info.path]
            result["ok"] = True
            if scenario == "rank0_only" and rank != 0:
                # the other ranks keep their writer open (heartbeating) until rank 0 is done
                _report(out, rank, result, started)
                dist.barrier()
        if scenario == "replicated":
            _restore_per_rank(root, rank, result, torch.rand(3))
    except checkpointd.CheckpointError as exc:
        result["error"] = type(exc).__name__
        result["message"] = str(exc)
    if scenario == "full_disk" and rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
    if scenario != "rank0_only" or rank == 0 or not result["ok"]:
        _report(out, rank, result, started)
    if scenario == "rank0_only" and rank == 0:
        dist.barrier()
    dist.destroy_process_group()


def _report(out: str, rank: int, result: dict[str, Any], started: float) -> None:
    result["seconds"] = time.monotonic() - started
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
