"""Overlapped vs blocking staging on CPU: what a save costs the training thread, side by side.

Run: ``python -m benchmarks.bench_overlap`` (``--smoke`` for a seconds-long check).
A CPU training loop (an MLP of ``--depth`` x ``--width`` linear layers, AdamW,
batch ``--batch``: by default ~400 MB of parameters and optimizer state) saves
its state with two writers that differ only in ``staging=``; windows alternate
between them. A window is one save followed by training steps until the save is
durable (at least ``--steps``); ``--idle`` steps without a save between windows
give the baseline step time. Per mode, medians over the windows:

- blocked: seconds ``save()`` held the training thread;
- staged: seconds from the call until the state was all in host memory;
- first step: the step right after ``save()`` (overlapped: its
  ``optimizer.step()`` waits there for the copy), minus the idle median;
- step time: the window's mean step time against the idle median;
- stall: ``save()`` plus the window's steps, minus as many idle steps: all the
  training time the save cost, the background write's competition for the
  cores included.

Prints the figures and the ratios overlapped / blocking. The ratios depend on the
machine (cores, memory bandwidth) and its load; not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import checkpointd
from checkpointd.write.staging import STAGING_MODES, StagingMode

MB = 10**6


def _loop(width: int, depth: int, batch: int) -> tuple[dict[str, Any], Callable[[], float]]:
    """The state to save and a function that runs one training step and returns its seconds."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x, y = torch.randn(batch, width), torch.randn(batch, width)

    def step() -> float:
        start = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return time.perf_counter() - start

    step()  # the optimizer state exists from here on
    return {"model": model, "optimizer": optimizer}, step


def _nbytes(state: dict[str, Any]) -> int:
    model, optimizer = state["model"], state["optimizer"]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    moments: int = sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    return int(params + moments)


def _record_staged(handle: checkpointd.SaveHandle, staged: list[float]) -> None:
    handle.wait_staged()
    staged.append(time.perf_counter())


def run(
    folder: Path,
    *,
    width: int,
    depth: int,
    batch: int,
    windows: int,
    steps: int,
    idle: int,
) -> dict[str, Any]:
    """Measure both modes, windows interleaved; returns the medians and the raw values."""
    state, step = _loop(width, depth, batch)
    for _ in range(2):
        step()
    raw: dict[StagingMode, dict[str, list[float]]] = {
        mode: {"blocked": [], "staged": [], "first_step": [], "step_change": [], "stall": []}
        for mode in STAGING_MODES
    }
    idle_steps: list[float] = []
    writers = {
        mode: checkpointd.CheckpointWriter(str(folder / mode), keep_last=1, staging=mode)
        for mode in STAGING_MODES
    }
    try:
        number = 0
        for writer in writers.values():
            number += 1
            writer.save(number, state).result()  # allocate the staging buffer
        idle_steps += [step() for _ in range(idle)]
        for _ in range(windows):
            for mode, writer in writers.items():
                number += 1
                staged: list[float] = []
                start = time.perf_counter()
                handle = writer.save(number, state)
                watcher = threading.Thread(target=_record_staged, args=(handle, staged))
                watcher.start()
                times: list[float] = []
                while len(times) < steps or not handle.done():  # until durable
                    times.append(step())
                window = time.perf_counter() - start
                handle.result()
                watcher.join()
                baseline = statistics.median(idle_steps)
                raw[mode]["blocked"].append(handle.blocked_seconds)
                raw[mode]["staged"].append(staged[0] - start)
                raw[mode]["first_step"].append(times[0] - baseline)
                raw[mode]["step_change"].append(statistics.mean(times) / baseline - 1)
                raw[mode]["stall"].append(window - len(times) * baseline)
                idle_steps += [step() for _ in range(idle)]
    finally:
        for writer in writers.values():
            writer.close()
    medians = {
        mode: {name: statistics.median(values) for name, values in figures.items()}
        for mode, figures in raw.items()
    }
    return {
        "state_mb": _nbytes(state) / MB,
        "idle_step": statistics.median(idle_steps),
        "median": medians,
        "raw": raw,
        "config": {
            "width": width,
            "depth": depth,
            "batch": batch,
            "windows": windows,
            "steps": steps,
            "idle": idle,
            "threads": torch.get_num_threads(),
        },
    }


def report(results: dict[str, Any]) -> str:
    """The figures as a table, and the ratios overlapped / blocking."""
    median = results["median"]
    rows = [
        f"state {results['state_mb']:.0f} MB (parameters + AdamW moments), idle step "
        f"{results['idle_step'] * 1e3:.1f} ms, {results['config']['windows']} windows per mode",
        f"{'':12}{'blocking':>12}{'overlapped':>12}{'ratio':>8}",
    ]
    for name, label in (
        ("blocked", "blocked"),
        ("staged", "staged"),
        ("first_step", "first step+"),
        ("stall", "stall"),
    ):
        b, o = median["blocking"][name], median["overlapped"][name]
        ratio = f"{o / b:.2f}" if b > 0 else "-"
        rows.append(f"{label:12}{b * 1e3:>10.1f}ms{o * 1e3:>10.1f}ms{ratio:>8}")
    b, o = median["blocking"]["step_change"], median["overlapped"]["step_change"]
    rows.append(f"{'step time':12}{b:>+12.0%}{o:>+12.0%}")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 2 windows")
    parser.add_argument("--dir", type=Path, default=None, help="where to save (a temp folder)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--idle", type=int, default=3)
    args = parser.parse_args(argv)
    if args.smoke:
        args.width, args.depth, args.batch, args.windows, args.steps, args.idle = 64, 2, 4, 2, 2, 2
    with tempfile.TemporaryDirectory(prefix="checkpointd-bench-", dir=args.dir) as folder:
        results = run(
            Path(folder),
            width=args.width,
            depth=args.depth,
            batch=args.batch,
            windows=args.windows,
            steps=args.steps,
            idle=args.idle,
        )
    print(report(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
