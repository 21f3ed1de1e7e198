"""Where a 2-rank FSDP2 ``save()`` spends its time, through the service and in-process.

    python -m benchmarks.service_phases [--mb 64] [--reps 7]

The job of ``bench_service --fsdp2-mb MB`` (rank_worker's FSDP2 MLP, AdamW), a
service per rank at its default priority; each rank saves WARMUP + REPS times with
an in-process writer and a service writer in turn (a barrier before each save).
Each save is timed by wrapping the functions it passes through (this process only;
nothing in checkpointd changes):

- ``acquire``: the staging buffer taken (a hop to the writer's loop thread);
- ``reserve``: the arena for the capture; through the service ``alloc`` (the
  ``Alloc`` round trip) and ``map`` (mapping the segment it handed over) of it;
- ``copy``: the rest of ``capture``, the copy of every tensor into the arena;
- ``submit``: handing the snapshot over (through the service ``describe`` and the
  ``submit_rtt`` of its ``Submit`` round trip, the rest thread hops);
- ``other``: ``save()`` blocked (its handle's ``blocked_seconds``) less all that.

Medians per rank and writer, after the WARMUP saves of each. A rank is run by
``main RANK WORLD PORT ...`` (this module, not by hand).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, repo_env, start_service

WORLD = 2
WARMUP = 2
PHASES = ("blocked", "acquire", "snapshot", "by_name", "reserve", "alloc", "map", "copy")
PHASES += ("submit", "on_loop", "describe", "submit_rtt", "other")

_current: dict[str, float] = defaultdict(float)


def _timed(owner: Any, name: str, phase: str | Callable[..., str | None]) -> None:
    """Wrap ``owner.name`` so its calls add their seconds to ``_current[phase]``
    (``phase`` may pick the phase from the call's arguments; None: not counted)."""
    real = getattr(owner, name)

    def count(started: float, args: Any, kwargs: Any) -> None:
        which = phase if isinstance(phase, str) else phase(*args, **kwargs)
        if which is not None:
            _current[which] += time.perf_counter() - started

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            count(started, args, kwargs)

    async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return await real(*args, **kwargs)
        finally:
            count(started, args, kwargs)

    if inspect.iscoroutinefunction(real):
        wrapper = async_wrapper
    setattr(owner, name, wrapper)


def _instrument() -> None:
    from checkpointd.api import writer_base
    from checkpointd.daemon.client import client, remote, segments
    from checkpointd.daemon.wire import protocol
    from checkpointd.state import optimizers
    from checkpointd.write import capture, lifecycle, loop

    def kind(_self: Any, message: type, **_: Any) -> str | None:
        return {protocol.Alloc: "alloc", protocol.Submit: "submit_rtt"}.get(message)

    _timed(lifecycle.LoopThread, "call_interruptibly", "acquire")
    _timed(lifecycle.LoopThread, "call", "submit")
    _timed(writer_base.WriterBase, "_snapshot", "snapshot")
    _timed(optimizers, "by_parameter_name", "by_name")
    _timed(capture.StagingBuffer, "reserve", "reserve")
    _timed(writer_base, "capture", "copy")  # less ``reserve``, below
    _timed(client.Connection, "request", kind)
    _timed(segments.Mappings, "map", "map")
    _timed(remote, "describe", "describe")
    for backend in (remote.ServiceBackend, loop.InProcessBackend):
        _timed(backend, "submit", "on_loop")


def rank_main(rank: int, port: str, sockets: str, folder: str, *, mb: float, reps: int) -> None:
    import torch.distributed as dist

    import checkpointd
    from benchmarks.rank_worker import build

    _instrument()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    model, optimizer = build(WORLD, mb)
    state = {"model": model, "optimizer": optimizer}
    writers = {
        "inproc": checkpointd.CheckpointWriter(os.path.join(folder, "inproc"), keep_last=1),
        "service": checkpointd.CheckpointWriter(
            os.path.join(folder, "svc"), keep_last=1, service=sockets.split(",")[rank]
        ),
    }
    times: dict[str, list[dict[str, float]]] = {name: [] for name in writers}
    try:
        order = list(writers.items())
        for rep in range(WARMUP + reps):
            for name, writer in order if rep % 2 == 0 else order[::-1]:
                dist.barrier()
                _current.clear()
                handle = writer.save(rep, state)
                phases = dict(_current)
                handle.result(600)
                phases["blocked"] = handle.blocked_seconds
                phases["copy"] = phases.get("copy", 0.0) - phases.get("reserve", 0.0)
                known = sum(phases.get(p, 0.0) for p in ("acquire", "snapshot", "submit"))
                phases["other"] = phases["blocked"] - known
                if rep >= WARMUP:
                    times[name].append(phases)
    finally:
        for writer in writers.values():
            writer.close()
    print(json.dumps({"rank": rank, "times": times}), flush=True)
    dist.destroy_process_group()


def run(mb: float, reps: int) -> list[dict[str, Any]]:
    """Each rank's ``{"rank": R, "times": {writer: [phases per save]}}``."""
    folders = [tempfile.mkdtemp(prefix="ckd-bench-", dir="/tmp") for _ in range(WORLD)]
    roots = tempfile.mkdtemp(prefix="ckd-phases-", dir="/tmp")
    services = [start_service(f) for f in folders]
    try:
        sockets = ",".join(os.path.join(f, "sock") for f in folders)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = str(probe.getsockname()[1])

        def _rank_args(rank: int) -> list[str]:
            return ["--rank", str(rank), "--port", port, "--sockets", sockets, "--folder", roots]

        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.service_phases",
                    *_rank_args(rank),
                    "--mb",
                    str(mb),
                    "--reps",
                    str(reps),
                ],
                env=repo_env(),
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                text=True,
            )
            for rank in range(WORLD)
        ]
        outputs = [proc.communicate(timeout=3600)[0] for proc in procs]
        if any(proc.returncode for proc in procs):
            raise RuntimeError(f"a rank failed: {[p.returncode for p in procs]}")
    finally:
        for proc in services:
            proc.terminate()
            proc.wait(60)
        for f in [*folders, roots]:
            shutil.rmtree(f, ignore_errors=True)
    return sorted(
        (json.loads(o.strip().splitlines()[-1]) for o in outputs), key=lambda r: r["rank"]
    )


def report(ranks: list[dict[str, Any]]) -> list[str]:
    lines = [f"medians in ms ({len(ranks[0]['times']['inproc'])} saves per writer and rank)"]
    lines.append(f"  {'rank writer':<16}" + "".join(f"{p:>11}" for p in PHASES))
    for entry in ranks:
        for name, saves in entry["times"].items():
            cells = [statistics.median(s.get(p, 0.0) for s in saves) * 1e3 for p in PHASES]
            label = f"{entry['rank']} {name}"
            lines.append(f"  {label:<16}" + "".join(f"{c:>11.2f}" for c in cells))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=64, help="the job's parameter MB")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", help="also write each rank's saves to this JSON file")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", help=argparse.SUPPRESS)
    parser.add_argument("--sockets", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank, args.port, args.sockets, args.folder, mb=args.mb, reps=args.reps)
        return 0
    print(f"load average before: {os.getloadavg()}")
    ranks = run(args.mb, args.reps)
    print(f"load average after: {os.getloadavg()}")
    print("\n".join(report(ranks)))
    if args.json:
        Path(args.json).write_text(json.dumps(ranks, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
