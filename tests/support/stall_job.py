"""One rank of a 2-rank job whose TCP store the launcher hosts (as torchrun's agent
does), for the tests of stalled and refusing ranks.

    python -m tests.support.stall_job SCENARIO ROOT OUT RANK WORLD PORT

Saves step 1 with ``keep_last=1`` ("first"), then step 2 ("middle"), during which
SCENARIO stops one rank with SIGSTOP at a chosen point (the test resumes it with
SIGCONT) or refuses the save on rank 1; then, once both are past it, step 3 (step 2
again after a refusal: "last"). Just before it stops, a rank writes
OUT/rank{RANK}-stopping.json: the point and the attempt's outcome as it is there (null
while undecided). After each save it writes OUT/rank{RANK}-{label}.json: ``ok``,
``error`` (class name), ``message``, ``seconds``; after the middle save rank 0 also
records what is committed and whether the newest checkpoint loads.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

import checkpointd
from checkpointd import tunables
from checkpointd.write import ranked_commit as rankcommit

SCENARIOS = (
    "publisher_stalled_before_deciding",
    "publisher_stalled_after_deciding",
    "follower_stalled_before_writing",
    "refused_on_one_rank",
)


def _stop_here(out: str, rank: int, point: str, attempt: Any = None) -> None:
    """Stop this process before the calling thread runs one more instruction: record
    ``point`` (and the attempt's outcome as it is now) first, for the test to check.

    The signal goes to the calling thread (the writer's event loop), which takes it
    before its system call returns; ``os.kill(os.getpid(), ...)`` would go to the process,
    whose main thread (waiting in ``result()``) takes it once scheduled, and under load
    the loop ran on meanwhile: it decided and published the step before the process
    stopped."""
    outcome = None if attempt is None else attempt.outcome()
    seen = {"point": point, "outcome": None if outcome is None else outcome.decode()}
    with open(os.path.join(out, f"rank{rank}-stopping.json"), "w") as f:
        json.dump(seen, f)
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def _arm(scenario: str, rank: int, out: str) -> None:
    """Make this rank stop itself at the scenario's point of step 2."""
    if scenario == "publisher_stalled_before_deciding" and rank == 0:
        gather = rankcommit.gather

        async def gather_then_stop(attempt: Any, kind: str, ranks: list[int], **kw: Any) -> Any:
            got = await gather(attempt, kind, ranks, **kw)
            if kind == "files" and attempt.step == 2:
                # every rank's files are durable; nothing decided yet
                _stop_here(out, rank, "gathered files", attempt)
            return got

        rankcommit.gather = gather_then_stop  # type: ignore[assignment]
    if scenario == "publisher_stalled_after_deciding" and rank == 0:
        publish = rankcommit.publish_manifest

        async def stop_then_publish(store: Any, manifest: Any, limiter: Any) -> None:
            if manifest.step == 2:
                # the commit is decided; the manifest not yet published
                _stop_here(out, rank, "publishing")
            await publish(store, manifest, limiter)

        rankcommit.publish_manifest = stop_then_publish  # type: ignore[assignment]
    if scenario == "follower_stalled_before_writing" and rank == 1:
        write_share = rankcommit._write_share  # noqa: SLF001 - fault: stop before the share is written

        async def stop_then_write(store: Any, plan: Any, *args: Any, **kw: Any) -> None:
            if plan.step == 2:
                _stop_here(out, rank, "writing its share", args[1])
            await write_share(store, plan, *args, **kw)

        rankcommit._write_share = stop_then_write  # type: ignore[assignment]  # noqa: SLF001 - fault: stop before the share is written


def _save(
    writer: checkpointd.CheckpointWriter,
    step: int,
    state: dict[str, Any],
    *,
    out: str,
    rank: int,
    label: str,
) -> None:
    result: dict[str, Any] = {"ok": False, "error": None, "message": ""}
    started = time.monotonic()
    try:
        writer.save(step, state).result()
        result["ok"] = True
    except checkpointd.CheckpointError as exc:
        result["error"] = type(exc).__name__
        result["message"] = str(exc)
    result["seconds"] = time.monotonic() - started
    if rank == 0 and label == "middle":
        result["committed"] = [c.step for c in checkpointd.list_checkpoints(writer.root)]
        try:
            checkpointd.load(writer.root)
            result["loads"] = True
        except checkpointd.CheckpointError as exc:
            result["loads"] = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out, f"rank{rank}-{label}.json"), "w") as f:
        json.dump(result, f)


def main() -> None:
    scenario, root, out, rank_s, world_s, port = sys.argv[1:]
    rank, world = int(rank_s), int(world_s)
    tunables.HEARTBEAT_SECONDS = 0.2
    tunables.STALE_SECONDS = 3.0
    # A refused save must fail the others at once, not after this long (the writer's option).
    join_seconds = 60.0 if scenario == "refused_on_one_rank" else 3.0
    store = dist.TCPStore("127.0.0.1", int(port), world, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    state: dict[str, Any] = {"model": model, "extra": {"table": torch.arange(4096.0)}}
    _arm(scenario, rank, out)
    with checkpointd.CheckpointWriter(root, keep_last=1, join_seconds=join_seconds) as writer:
        _save(writer, 1, state, out=out, rank=rank, label="first")
        if scenario == "refused_on_one_rank" and rank == 1:
            _save(writer, 2, {**state, "bad": object()}, out=out, rank=rank, label="middle")
        else:
            _save(writer, 2, state, out=out, rank=rank, label="middle")
        dist.barrier()  # every rank is past step 2 (the stopped one once resumed)
        with torch.no_grad():
            model.weight.add_(1.0)
        # the job goes on: a retry of step 2 after the refusal, else the next step
        step = 2 if scenario == "refused_on_one_rank" else 3
        _save(writer, step, state, out=out, rank=rank, label="last")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
