"""``benchmarks.bench_service``'s FSDP2 rows: ``fsdp2_rows`` runs a 2-rank job, each
rank with a service of its own; ``main`` is one rank (run by it, not by hand).

    python -m benchmarks.service_rank_worker SOCKETS MB REPS FOLDER OUT RANK WORLD PORT

Builds rank_worker's FSDP2 MLP (about MB megabytes of float32 parameters, AdamW state
after one step), then saves it WARMUP + REPS times with each writer of the job's
default group, the order rotating from one repetition to the next: in-process
(FOLDER/inproc), and one per service kind of SOCKETS (``KIND=S0,S1;KIND=S0,S1``: this
rank uses the RANK-th socket; FOLDER/KIND). Each save's ``save()`` blocked and time
until durable (its handle's ``blocked_seconds``/``durable_seconds``), with a barrier
before each save; then REPS restores of the first service kind's root from the memory
tier (each rank from its own service) and of the in-process root from local disk with
a cold page cache. Writes OUT/rankR.json: ``{"inproc": [[blocked, durable], ...],
KIND: [...], "restore": [[memory, disk_cold], ...]}``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

import checkpointd
from benchmarks.common import Table, drop_cache, spawn
from benchmarks.rank_worker import WIDTH, build

WARMUP = 2
"""Saves per writer measured apart (the first saves allocate), as in bench_service."""

WORLD = 2
REPO = Path(__file__).resolve().parents[1]

SERVICES = {"service": (), "service_nice0": ("--niceness", "0", "--io-priority", "none")}
"""The services each rank saves through: at their default priority (niceness 10, I/O
best effort 7), and at the trainer's."""


def fsdp2_rows(
    folder: Path,
    mb: float,
    reps: int,
    table: Table,
    *,
    start_service: Callable[..., subprocess.Popen[bytes]],
    env: dict[str, str],
) -> int:
    """The FSDP2 job on 2 ranks, each rank with a service of each ``SERVICES`` kind of
    its own (``start_service(folder, *args)`` starts one at FOLDER/sock):
    ``fsdp2.<inproc|kind>.[first]blocked``/``durable``, each save the slowest rank's.
    Returns the job's state size in bytes (parameters and AdamW's moments, float32)."""
    folders = {
        kind: [tempfile.mkdtemp(prefix="ckd-bench-", dir="/tmp") for _ in range(WORLD)]
        for kind in SERVICES
    }
    out = folder / "fsdp2-out"
    out.mkdir()
    services: list[subprocess.Popen[bytes]] = []
    try:
        for kind, args in SERVICES.items():
            services += [start_service(f, *args) for f in folders[kind]]
        sockets = ";".join(
            f"{kind}=" + ",".join(os.path.join(f, "sock") for f in kind_folders)
            for kind, kind_folders in folders.items()
        )
        port = str(_free_port())
        args = [sockets, str(mb), str(reps), str(folder / "fsdp2"), str(out)]
        procs = [
            spawn(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.service_rank_worker",
                    *args,
                    str(rank),
                    str(WORLD),
                    port,
                ],
                env=env,
                cwd=REPO,
                stdin=subprocess.DEVNULL,
            )
            for rank in range(WORLD)
        ]
        for proc in procs:
            if proc.wait(3600) != 0:
                raise RuntimeError(f"an FSDP2 rank exited with {proc.returncode}")
    finally:
        for proc in services:
            proc.terminate()
            proc.wait(60)
        for kind_folders in folders.values():
            for f in kind_folders:
                shutil.rmtree(f, ignore_errors=True)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for rows in zip(*(r["restore"] for r in ranks), strict=True):
        table.add("fsdp2.restore.memory", max(m for m, _ in rows))
        table.add("fsdp2.restore.disk_cold", max(d for _, d in rows))
    for name in ("inproc", *SERVICES):
        for rep, per_rank in enumerate(zip(*(r[name] for r in ranks), strict=True)):
            kind = "first" if rep < WARMUP else ""
            table.add(f"fsdp2.{name}.{kind}blocked", max(b for b, _ in per_rank))
            table.add(f"fsdp2.{name}.{kind}durable", max(d for _, d in per_rank))
    layers = max(1, round(mb * 2**20 / (4 * WIDTH * (WIDTH + 1))))  # as rank_worker.build
    return 3 * layers * 4 * WIDTH * (WIDTH + 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _restores(
    state: dict[str, Any], folder: str, kind: str, socket: str, reps: int
) -> list[list[float]]:
    """``reps`` times: [seconds to restore the newest step of FOLDER/KIND from its
    services' memory tier (every rank's files from its own service), seconds to restore
    the in-process root's from local disk with a cold page cache], each after a
    barrier; AssertionError unless every file came from memory."""
    rows = []
    for _ in range(reps):
        dist.barrier()
        started = time.perf_counter()
        info = checkpointd.restore(os.path.join(folder, kind), state, service=socket)
        memory = time.perf_counter() - started
        assert info.source == "memory", info.source
        drop_cache(Path(folder) / "inproc")
        dist.barrier()
        started = time.perf_counter()
        info = checkpointd.restore(os.path.join(folder, "inproc"), state)
        rows.append([memory, time.perf_counter() - started])
    return rows


def main() -> None:
    sockets, mb, reps_s, folder, out, rank_s, world_s, port = sys.argv[1:]
    rank, world, reps = int(rank_s), int(world_s), int(reps_s)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    model, optimizer = build(world, float(mb))
    state = {"model": model, "optimizer": optimizer}
    writers = {"inproc": checkpointd.CheckpointWriter(os.path.join(folder, "inproc"), keep_last=1)}
    for entry in sockets.split(";"):
        kind, paths = entry.split("=")
        writers[kind] = checkpointd.CheckpointWriter(
            os.path.join(folder, kind), keep_last=1, service=paths.split(",")[rank]
        )
    times: dict[str, list[list[float]]] = {name: [] for name in writers}
    try:
        order = list(writers.items())
        for rep in range(WARMUP + reps):
            shift = rep % len(order)
            for name, writer in order[shift:] + order[:shift]:
                dist.barrier()
                handle = writer.save(rep, state)
                handle.result(600)
                assert handle.durable_seconds is not None
                times[name].append([handle.blocked_seconds, handle.durable_seconds])
    finally:
        for writer in writers.values():
            writer.close()
    kind, paths = sockets.split(";")[0].split("=")
    times["restore"] = _restores(state, folder, kind, paths.split(",")[rank], reps)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(times, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
