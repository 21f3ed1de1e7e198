"""Suite sections for a process that lives on (issue 35): ``load`` repeated in a
long-lived process beside a fresh process's, and training throughput over windows
that contain a save.

- ``load``: ``torch.load`` and ``checkpointd.load`` of one model, each in a fresh
  process (what a resume does), and both alternating in one process that saved 3
  steps with a writer first and lives on (an eval loop over checkpoints, RL weight
  sync): bench_restore's children, medians and ratios (goals <= 0.7x and <= 1.0x).
- ``window``: bench_window: tokens per second over windows that contain a save, in
  process and through the service at its default priority, against windows that do
  not (goals >= 0.90x and >= 0.95x), and over each save's own span.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import checkpointd
from benchmarks import bench_restore, bench_window
from benchmarks.common import MiB, Table, fmt_seconds, spawn_output, work_dir

if TYPE_CHECKING:
    from benchmarks.sections import Config

LOAD_GOALS = {"fresh": 0.7, "long_lived": 1.0}
"""checkpointd.load / torch.load, per process kind (issue 35 item 1)."""


def _child(kind: str, where: Path, d: int) -> dict[str, Any]:
    """bench_restore's child process of ``kind`` on ``where`` (``spawn``'s): its JSON result."""
    out = spawn_output(
        [sys.executable, "-m", "benchmarks.bench_restore", "--child", kind, str(where), str(d)],
        {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def load(cfg: Config) -> dict[str, Any]:
    """``load`` in a fresh process and repeated in a long-lived one, beside ``torch.load``."""
    mb = 2 if cfg.smoke else 705
    reps = 2 if cfg.smoke else (3 if cfg.quick else 5)
    fresh_reps = 1 if cfg.smoke else (2 if cfg.quick else 3)
    d = bench_restore.width_for(mb)
    table = Table()
    with work_dir(cfg.folder, "load") as folder:
        model = bench_restore.build(d)
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        path, root = folder / "model.pt", folder / "ckpt"
        torch.save(model.state_dict(), path)
        with checkpointd.CheckpointWriter(str(root)) as writer:
            writer.save(1, {"model": model}).result()
        del model
        cfg.log(f"[load] {nbytes / MiB:.0f} MiB model, {fresh_reps} fresh rounds, {reps} loads")
        kinds = [("torch.load", path), ("checkpointd.load", root)]
        for rep in range(fresh_reps):
            for kind, where in kinds[rep % 2 :] + kinds[: rep % 2]:
                result = _child(kind, where, d)
                table.add(f"{kind}.fresh", result["seconds"])
        lived = _child(f"long-lived:{reps}", folder, d)
        for name, _ in kinds:
            for seconds in lived[name]:
                table.add(f"{name}.long_lived", seconds)
    ratios = {
        process: table.ratio(f"checkpointd.load.{process}", f"torch.load.{process}")
        for process in LOAD_GOALS
    }
    lines = [f"  {name:<30} {fmt_seconds(series)}" for name, series in table.series.items()]
    for process, ratio in ratios.items():
        goal = LOAD_GOALS[process]
        mark = "ok" if ratio <= goal else f"MISSED (goal <= {goal})"
        lines.append(f"  load {process}: checkpointd / torch {ratio:6.2f}x {mark}")
    cfg.log("\n".join(lines))
    return {
        "nbytes": nbytes,
        "series": table.as_json(),
        "ratios": ratios,
        "long_lived_peak_rss": lived["peak_rss"],
    }


def window(cfg: Config) -> dict[str, Any]:
    """Tokens per second over windows with a save against windows without (bench_window)."""
    with work_dir(cfg.folder, "window") as folder:
        results = bench_window.run(
            folder,
            shape=bench_window.SMOKE if cfg.smoke else bench_window.Shape(),
            frozen_bytes=MiB if cfg.smoke else 604 * 10**6,
            rounds=1 if cfg.smoke else (5 if cfg.quick else 9),
            window_steps=4 if cfg.smoke else None,
            warmup=1 if cfg.smoke else bench_window.WARMUP,
            log=cfg.log,
        )
    cfg.log("\n".join(bench_window.report(results)))
    return {key: value for key, value in results.items() if key != "table"}


__all__ = ["load", "window"]
