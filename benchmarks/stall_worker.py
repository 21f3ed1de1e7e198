"""One rank of ``benchmarks.bench_stall`` (run by it, not by hand).

    python -m benchmarks.stall_worker MB REPS FOLDER OUT RANK WORLD PORT

Builds rank_worker's FSDP2 MLP (about MB megabytes of float32 parameters, AdamW
state after one step), then per repetition, with a barrier before each and in an
order that alternates: ``memcpy`` (a one-thread copy of this rank's own shards,
the floor the earlier rounds compared to), ``ranked`` (this rank's part of the
group's ``save()``) and ``local`` (a writer of this process alone saving the same
shards as plain tensors: the single-process capture of the same bytes). Each
save's blocked seconds are split into phases by wrapping the functions it passes
through (this process only; nothing in checkpointd changes, and nothing
recursive is wrapped, so the wrappers cost microseconds):

- ``acquire``: the staging buffer taken (a hop to the writer's loop thread);
- ``by_name``: optimizers stored by parameter name (DCP's ``get_optimizer_state_dict``);
- ``state_dict``: each component's ``state_dict()``;
- ``walk``: the rest of capture before the copy: the tree walk (DTensors' local
  shards, placements), the shard plan and the arena's layout;
- ``reserve``: the staging arena taken;
- ``copy``: every tensor copied into the arena;
- ``submit``: the snapshot queued to the writer's loop;
- ``other``: ``save()`` blocked less all that (checks, the attempt number, the
  hand-shake of an overlapped save, the handle);
- ``cpu``: the CPU seconds of the whole process meanwhile (the caller's and the
  copy's helper threads'): the work, without the waits for a core that a busy
  machine adds to the blocked seconds.

Writes OUT/rankR.json: per save kind, a list of per-repetition phase dicts.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

import checkpointd
from benchmarks.rank_worker import build, local_tensors

WARMUP = 2
PHASES = ("acquire", "by_name", "state_dict", "walk", "reserve", "copy", "submit", "other")

_current: dict[str, float] = defaultdict(float)


def _timed(owner: Any, name: str, phase: str) -> None:
    """Wrap ``owner.name`` (if it exists in this version) so its calls add their seconds to
    ``_current[phase]``."""
    real = getattr(owner, name, None)
    if real is None:
        return

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            _current[phase] += time.perf_counter() - started

    setattr(owner, name, wrapper)


def instrument() -> None:
    """Wrap the functions a save passes through (see the module's docstring)."""
    from checkpointd.api import writer_base
    from checkpointd.state import optimizers
    from checkpointd.write import capture, lifecycle

    _timed(lifecycle.LoopThread, "call_interruptibly", "acquire")
    _timed(lifecycle.LoopThread, "call", "submit")
    _timed(optimizers, "by_parameter_name", "by_name")
    _timed(writer_base, "capture", "capture")  # split below
    _timed(capture, "component_state", "state_dict")
    _timed(capture.StagingBuffer, "reserve", "reserve")
    _timed(capture, "copy_now", "copy")


def phases(blocked: float) -> dict[str, float]:
    """The phases of the save just made, from ``_current`` and its blocked seconds."""
    got = dict(_current)
    captured = got.pop("capture", 0.0)
    got["walk"] = captured - sum(got.get(k, 0.0) for k in ("state_dict", "reserve", "copy"))
    named = {key: got.get(key, 0.0) for key in PHASES if key != "other"}
    named["other"] = blocked - sum(named.values())
    named["blocked"] = blocked
    return named


@contextlib.contextmanager
def measured(times: dict[str, list[dict[str, float]]], kind: str) -> Iterator[None]:
    """Time the ``save()`` inside: its blocked seconds and their phases under ``kind``."""
    dist.barrier()
    _current.clear()
    cpu, started = time.process_time(), time.perf_counter()
    yield
    blocked, cpu = time.perf_counter() - started, time.process_time() - cpu
    times.setdefault(kind, []).append({**phases(blocked), "cpu": cpu})


def memcpy(shards: list[torch.Tensor], arena: torch.Tensor) -> None:
    """A one-thread copy of ``shards`` into ``arena``, one after another."""
    at = 0
    for t in shards:
        n = t.numel() * t.element_size()
        arena[at : at + n].view(t.dtype).view(t.shape).copy_(t)
        at += n


def main() -> None:
    mb, reps, folder, out, rank_s, world_s, port = sys.argv[1:]
    rank, world = int(rank_s), int(world_s)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    instrument()
    model, optimizer = build(world, float(mb))
    shards = local_tensors(model, optimizer)
    plain = {str(i): t for i, t in enumerate(shards)}
    arena = torch.empty(sum(t.numel() * t.element_size() for t in shards), dtype=torch.uint8)
    times: dict[str, list[dict[str, float]]] = {}
    with (
        checkpointd.CheckpointWriter(os.path.join(folder, "ranked"), keep_last=1) as ranked,
        checkpointd.CheckpointWriter(
            os.path.join(folder, f"local{rank}"), keep_last=1, process_group=checkpointd.LOCAL
        ) as local,
    ):
        saves: list[tuple[str, Callable[[int], None]]] = [
            ("ranked", lambda step: ranked.save(step, {"model": model, "optimizer": optimizer})),
            ("local", lambda step: local.save(step, {"shards": plain})),
            ("memcpy", lambda step: memcpy(shards, arena)),
        ]
        for rep in range(WARMUP + int(reps)):
            for kind, save in saves if rep % 2 == 0 else saves[::-1]:
                with measured(times, kind):
                    save(rep)
                ranked.wait()
                local.wait()
                if rep < WARMUP:
                    times[kind].pop()
    times["nbytes"] = [{"shards": float(arena.numel())}]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(times, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
