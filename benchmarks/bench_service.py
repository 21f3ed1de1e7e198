"""The checkpoint service against the in-process writer, side by side in one run.

Same state, interleaved repetitions, medians and ratios:
- ``save()`` blocked and time until durable, in-process vs through the service (the
  first two saves of each apart: they allocate);
- a restart's ``restore``: from the service's memory tier vs from local disk with the
  checkpoint's pages evicted (posix_fadvise), beside the memcpy of the state; and the
  CPU seconds of the memory restore beside those of a one-thread memcpy (the work
  ratio, which a busy machine's load does not bend as it bends wall times);
- training step time while a save is in flight: in-process writer, the service at its
  default priority (niceness 10, I/O best effort 7) and at the trainer's (``--niceness 0
  --io-priority none``), with the time until durable of each;
- kill -9 of a trainer at random moments after ``save()`` returned (kill_trainers.py):
  how many of those checkpoints committed, each checked bit-exact;
- a 2-rank gloo FSDP2 job (service_rank_worker.py, a service per rank at the default
  priority and one at the trainer's): ``save()`` blocked and time until durable,
  in-process vs through the service, each the slowest rank's; and a restart's
  ``restore`` on both ranks from their services' memory tier vs from local disk with a
  cold page cache (the slowest rank's).

``python -m benchmarks.bench_service [--layers 12 --width 1024] [--reps 5] [--kills 50]
[--fsdp2-mb 64] [--no-training]`` (the default state is bench_save's 604 MB model; the
FSDP2 job's parameters are MB megabytes, its state with AdamW three times that; 0 skips
it); ``--smoke`` runs a tiny version.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import checkpointd
from benchmarks.common import (
    Table,
    drop_cache,
    fmt_seconds,
    memcpy_floor,
    nbytes_of,
    pick_folder,
    repo_env,
    start_service,
    tensors_of,
    transformer,
    work_dir,
)
from benchmarks.kill_trainers import kill_trials
from benchmarks.service_rank_worker import fsdp2_rows

WARMUP = 2
"""Saves per writer measured apart (``*.firstblocked``/``*.firstdurable``): with
``keep_last`` and the memory tier at 1, the service's third save is the first to
reuse a segment."""


def _training_during_saves(
    writers: dict[str, checkpointd.CheckpointWriter], frozen: Any, windows: int, table: Table
) -> None:
    """A CPU training loop (4 x 512-wide linear layers, AdamW, batch 256) saving its state
    plus ``frozen``; save windows alternate between ``writers``, idle steps between:
    ``train.idle``, ``train.<name>`` (each step while a save is in flight) and
    ``train.<name>.durable``."""
    width, batch = 512, 256
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    optimizer = torch.optim.AdamW(model.parameters())
    state = {"model": model, "optimizer": optimizer, "frozen": frozen}
    x, y = torch.randn(batch, width), torch.randn(batch, width)

    def step() -> float:
        started = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return time.perf_counter() - started

    for _ in range(5):
        step()
    for writer in writers.values():
        for warm in range(WARMUP):
            writer.save(warm, state).result(600)
    saves = WARMUP
    for window in range(windows):
        order = list(writers.items())
        for name, writer in order if window % 2 == 0 else order[::-1]:
            handle = writer.save(saves, state)
            saves += 1
            while not handle.done():
                table.add(f"train.{name}", step())
            handle.result(600)
            assert handle.durable_seconds is not None
            table.add(f"train.{name}.durable", handle.durable_seconds)
            for _ in range(10):
                table.add("train.idle", step())


def _training_rows(folder: Path, socket: str, frozen: Any, windows: int, table: Table) -> None:
    """``_training_during_saves`` for the in-process writer, the service at ``socket``
    (default priority) and one more service at the trainer's priority."""
    plain = tempfile.mkdtemp(prefix="ckd-bench-", dir="/tmp")
    full = start_service(plain, "--niceness", "0", "--io-priority", "none")
    try:
        trainers = {
            "inproc": checkpointd.CheckpointWriter(str(folder / "t-inproc"), keep_last=1),
            "service": checkpointd.CheckpointWriter(
                str(folder / "t-svc"), keep_last=1, service=socket
            ),
            "service_nice0": checkpointd.CheckpointWriter(
                str(folder / "t-svc0"), keep_last=1, service=os.path.join(plain, "sock")
            ),
        }
        try:
            _training_during_saves(trainers, frozen, windows, table)
        finally:
            for writer in trainers.values():
                writer.close()
    finally:
        full.terminate()
        full.wait(60)
        shutil.rmtree(plain, ignore_errors=True)


def _cpu_seconds(work: Callable[[], object] | None = None) -> float:
    """CPU seconds this process (all its threads) spent: so far, or in ``work``."""
    if work is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    before = _cpu_seconds()
    work()
    return _cpu_seconds() - before


def _copy_one_thread(sources: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
    """The memcpy of the state on one thread (numpy): its CPU time is the copy's work,
    without the wait of torch's intra-op threads for a core on a busy machine."""
    for source, target in zip(sources, targets, strict=True):
        np.copyto(target.numpy(), source.detach().numpy())


RATIOS = [
    ("blocked service/inproc", "service.blocked", "inproc.blocked"),
    ("durable service/inproc", "service.durable", "inproc.durable"),
    ("restore memory/memcpy", "restore.memory", "memcpy"),
    ("restore disk_cold/memory", "restore.disk_cold", "restore.memory"),
    ("restore memory CPU / one-thread memcpy CPU", "restore.memory.cpu", "memcpy.cpu"),
    ("train step during save inproc/idle", "train.inproc", "train.idle"),
    ("train step during save service/idle", "train.service", "train.idle"),
    ("train step during save service_nice0/idle", "train.service_nice0", "train.idle"),
    ("durable while training service/inproc", "train.service.durable", "train.inproc.durable"),
    (
        "durable while training service_nice0/inproc",
        "train.service_nice0.durable",
        "train.inproc.durable",
    ),
]
"""(label, numerator series, denominator series) of the ratios reported (of medians)."""


def _kill_rows(folder: Path, nbytes: int, kills: int) -> dict[str, Any]:
    """``kill_trainers.kill_trials`` against a service of its own, capped at 1 GiB of shared
    memory (each trial's root keeps a copy in memory: the cap evicts them), each trainer
    saving a tensor of at most 32 MB per step."""
    sockets = tempfile.mkdtemp(prefix="ckd-bench-", dir="/tmp")
    service = start_service(sockets, "--memory-limit", "1G")
    try:
        numel = max(1, min(nbytes // 4, 8 * 1024 * 1024))
        return kill_trials(os.path.join(sockets, "sock"), folder, kills, numel, repo_env())
    finally:
        service.terminate()
        service.wait(60)
        shutil.rmtree(sockets, ignore_errors=True)


def run(
    layers: int,
    width: int,
    reps: int,
    kills: int,
    folder: Path,
    *,
    fsdp2_mb: float = 0,
    training: bool = True,
) -> dict[str, Any]:
    model = transformer(layers, width)
    state = {"model": model}
    nbytes = nbytes_of(state)
    sources = tensors_of(state)
    targets = [torch.empty_like(t) for t in sources]
    for t in targets:
        t.zero_()
    sockets = tempfile.mkdtemp(prefix="ckd-bench-", dir="/tmp")
    service = start_service(sockets)
    socket = os.path.join(sockets, "sock")
    table = Table()
    try:
        local = checkpointd.CheckpointWriter(str(folder / "inproc"), keep_last=1)
        remote = checkpointd.CheckpointWriter(str(folder / "svc"), keep_last=1, service=socket)
        with local, remote:
            for rep in range(WARMUP + reps):
                table.add("memcpy", memcpy_floor(sources, targets))
                order = [("inproc", local), ("service", remote)]
                # The first saves of a size allocate: the in-process writer its staging
                # buffer, the service a fresh segment per save until one is freed.
                kind = "first" if rep < WARMUP else ""
                for name, writer in order if rep % 2 == 0 else order[::-1]:
                    handle = writer.save(rep, state)
                    handle.result(600)
                    table.add(f"{name}.{kind}blocked", handle.blocked_seconds)
                    assert handle.durable_seconds is not None
                    table.add(f"{name}.{kind}durable", handle.durable_seconds)
        restored = transformer(layers, width, seed=1)
        for _ in range(reps):
            table.add("memcpy", memcpy_floor(sources, targets))  # beside each restore too
            table.add("memcpy.cpu", _cpu_seconds(lambda: _copy_one_thread(sources, targets)))
            started, cpu = time.perf_counter(), _cpu_seconds()
            info = checkpointd.restore(str(folder / "svc"), {"model": restored}, service=socket)
            table.add("restore.memory", time.perf_counter() - started)
            table.add("restore.memory.cpu", _cpu_seconds() - cpu)
            assert info.source == "memory", info.source
            drop_cache(folder / "inproc")
            started = time.perf_counter()
            info = checkpointd.restore(str(folder / "inproc"), {"model": restored})
            table.add("restore.disk_cold", time.perf_counter() - started)
        if training:
            _training_rows(folder, socket, model, reps, table)
        kill9 = _kill_rows(folder, nbytes, kills)
        fsdp2_bytes = 0
        if fsdp2_mb > 0:
            fsdp2_bytes = fsdp2_rows(
                folder, fsdp2_mb, reps, table, start_service=start_service, env=repo_env()
            )
    finally:
        service.terminate()
        service.wait(60)
        shutil.rmtree(sockets, ignore_errors=True)
    return {
        "nbytes": nbytes,
        "series": table.as_json(),
        "ratios": {
            label: table.ratio(numerator, denominator)
            for label, numerator, denominator in RATIOS
            if numerator in table.series and denominator in table.series
        },
        "kill9": kill9,
        "fsdp2": {}
        if fsdp2_mb <= 0
        else {
            "state_bytes": fsdp2_bytes,
            **{
                f"{measure} {kind}/inproc": table.ratio(
                    f"fsdp2.{kind}.{measure}", f"fsdp2.inproc.{measure}"
                )
                for measure in ("blocked", "durable")
                for kind in ("service", "service_nice0")
            },
            "restore disk_cold/memory": table.ratio(
                "fsdp2.restore.disk_cold", "fsdp2.restore.memory"
            ),
        },
        "table": table,
    }


def report(results: dict[str, Any]) -> list[str]:
    table: Table = results["table"]
    lines = [f"state: {results['nbytes'] / 1e6:.0f} MB (medians, interleaved)"]
    for name in (
        "memcpy",
        "inproc.firstblocked",
        "service.firstblocked",
        "inproc.blocked",
        "service.blocked",
        "inproc.durable",
        "service.durable",
        "restore.memory",
        "restore.disk_cold",
        "memcpy.cpu",
        "restore.memory.cpu",
        "train.idle",
        "train.inproc",
        "train.service",
        "train.service_nice0",
        "train.inproc.durable",
        "train.service.durable",
        "train.service_nice0.durable",
    ):
        if name in table.series:  # (no training rows with --no-training)
            lines.append(f"  {name:<28} {fmt_seconds(table[name])}")
    for name, value in results["ratios"].items():
        lines.append(f"  {name:<44} {value:.2f}x")
    if results["fsdp2"]:
        fsdp2 = results["fsdp2"]
        lines.append(f"  2-rank FSDP2 job, state {fsdp2['state_bytes'] / 1e6:.0f} MB:")
        for name in ("inproc", "service", "service_nice0"):
            for kind in ("firstblocked", "blocked", "firstdurable", "durable"):
                series = f"fsdp2.{name}.{kind}"
                lines.append(f"    {series:<32} {fmt_seconds(table[series])}")
        for series in ("fsdp2.restore.memory", "fsdp2.restore.disk_cold"):
            lines.append(f"    {series:<32} {fmt_seconds(table[series])}")
        for name, value in fsdp2.items():
            if name != "state_bytes":
                lines.append(f"    fsdp2 {name:<38} {value:.2f}x")
    kill = results["kill9"]
    lines.append(
        f"  kill -9 after save() returned: {kill['killed']} trainers killed, "
        f"{kill['committed_bit_exact']} of {kill['returned']} returned saves committed "
        f"bit-exact ({kill['seconds']:.0f} s)"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--kills", type=int, default=50, help="trainers killed -9 (default 50)")
    parser.add_argument(
        "--fsdp2-mb", type=float, default=64, help="FSDP2 job's parameter MB (0: skip it)"
    )
    parser.add_argument("--dir", help="folder to write in (default $CHECKPOINTD_BENCH_DIR or /tmp)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument(
        "--no-training", action="store_true", help="leave out the training-step rows"
    )
    parser.add_argument("--smoke", action="store_true", help="a tiny state, 2 reps, 1 kill")
    args = parser.parse_args(argv)
    if args.smoke:
        args.layers, args.width, args.reps, args.kills, args.fsdp2_mb = 1, 64, 2, 1, 1
    parent = pick_folder(args.dir, 0)
    with work_dir(parent, "service") as folder:
        results = run(
            args.layers,
            args.width,
            args.reps,
            args.kills,
            folder,
            fsdp2_mb=args.fsdp2_mb,
            training=not args.no_training,
        )
    print("\n".join(report(results)))
    if args.json:
        shown = {k: v for k, v in results.items() if k != "table"}
        Path(args.json).write_text(json.dumps(shown, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
