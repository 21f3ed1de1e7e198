"""CPU seconds one save costs, in the trainer's process and in the service's.

On a node whose cores the training job keeps busy, every CPU second a save spends
is taken from training, wherever it runs; unlike a throughput window this figure
hardly moves with the machine's load. The state is bench_window's (its language
model, AdamW and ``--frozen-mb`` MB of frozen weights); with nothing else running,
each writer kind (``inproc``, ``service``: a service at its default priority)
makes ``--saves`` saves one after another (each waited for until durable) after two
warm-up saves, in ``--rounds`` rounds that alternate the kinds. Per save: the CPU
seconds of this process (all its threads: capture, and the in-process writer's)
and of the service process (all its threads), from the kernel's per-process
totals, and the seconds until durable; medians over rounds with [min..max].

``python -m benchmarks.bench_save_cpu [--frozen-mb 604] [--saves 10] [--rounds 3]``;
``--smoke``: a tiny state, one round of two saves.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import checkpointd
from benchmarks.bench_window import SMOKE, Shape, Trainer
from benchmarks.common import MiB, Table, start_service

KINDS = ("inproc", "service")


def _process_cpu(pid: int) -> float:
    """CPU seconds so far of process ``pid``, every thread of it (the kernel's total)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _own_cpu() -> float:
    times = os.times()
    return times.user + times.system


def _round(trainer: Trainer, kind: str, saves: int, table: Table) -> None:
    """``saves`` saves of ``trainer.state`` by a writer of ``kind`` (a fresh root, and
    for ``service`` a fresh service), after two warm-up saves; adds the per-save means."""
    folder = tempfile.mkdtemp(prefix="ckd-savecpu-", dir="/tmp")
    service = start_service(folder) if kind == "service" else None
    try:
        writer = checkpointd.CheckpointWriter(
            os.path.join(folder, "root"),
            keep_last=1,
            service=None if service is None else os.path.join(folder, "sock"),
        )
        with writer:
            for step in range(2):
                writer.save(step, trainer.state).result(600)
            time.sleep(0.2)  # the warm-up's retention and replies settle
            own, theirs = _own_cpu(), 0.0 if service is None else _process_cpu(service.pid)
            durable = 0.0
            for step in range(2, 2 + saves):
                handle = writer.save(step, trainer.state)
                handle.result(600)
                assert handle.durable_seconds is not None
                durable += handle.durable_seconds
            time.sleep(0.2)  # the last save's retention and replies
            own = _own_cpu() - own
            theirs = 0.0 if service is None else _process_cpu(service.pid) - theirs
    finally:
        if service is not None:
            service.terminate()
            service.wait(60)
        shutil.rmtree(folder, ignore_errors=True)
    table.add(f"{kind}.trainer", own / saves)
    table.add(f"{kind}.service", theirs / saves)
    table.add(f"{kind}.total", (own + theirs) / saves)
    table.add(f"{kind}.durable", durable / saves)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frozen-mb", type=float, default=604, help="frozen weights' MB")
    parser.add_argument("--saves", type=int, default=10, help="saves per round and kind")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, alternating the kinds")
    parser.add_argument("--smoke", action="store_true", help="a tiny state, one round")
    args = parser.parse_args(argv)
    shape = SMOKE if args.smoke else Shape()
    trainer = Trainer(shape, 1 * MiB if args.smoke else int(args.frozen_mb * 1e6))
    for _ in range(3):
        trainer.step()
    saves, rounds = (2, 1) if args.smoke else (args.saves, args.rounds)
    table = Table()
    for number in range(rounds):
        for kind in KINDS if number % 2 == 0 else KINDS[::-1]:
            _round(trainer, kind, saves, table)
    print(f"load average {os.getloadavg()}")
    print(f"CPU seconds per save ({saves} saves x {rounds} rounds; median [min..max]):")
    for kind in KINDS:
        cells = []
        for what in ("trainer", "service", "total"):
            values = table[f"{kind}.{what}"].values
            cells.append(
                f"{what} {table[f'{kind}.{what}'].median:.3f} [{min(values):.3f}..{max(values):.3f}]"
            )
        cells.append(f"durable {table[f'{kind}.durable'].median:.2f} s")
        print(f"  {kind:<8} " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
