"""Run the benchmark suite: ``python -m benchmarks.run [--quick | --smoke] [--only SECTION ...]``.

Writes ``results.json`` and PNG plots to ``benchmarks/results/`` (or ``--out``)
and prints every figure. Sections: large (604 MB and 1.8 GB states against
torch.save, safetensors, DCP save/async_save, floors, peak RSS), small (20,000
tensors), training (step slowdown during a background save), s3 (moto),
scaling (10 MB up to 2 GB; ``--max-gb 4`` for 4 GB, needing ~12 GB of RAM),
stall (2-rank FSDP2 save() blocked by phase beside a single-process capture of the
same shards), load (load in a fresh process beside one repeated in a long-lived
process), window (training throughput over windows that contain a save against
windows without), and peers (4 services: a lost node's restore from a peer's
memory vs storage).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from benchmarks.common import GB, describe, machine, pick_folder
from benchmarks.sections import SECTIONS, Config

RESULTS = Path(__file__).parent / "results"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="fewer reps, 604 MB only, up to 1 GB")
    mode.add_argument("--smoke", action="store_true", help="tiny sizes, seconds (CI)")
    parser.add_argument("--only", nargs="+", choices=sorted(SECTIONS), help="run these sections")
    parser.add_argument("--dir", help="folder to write in (default $CHECKPOINTD_BENCH_DIR or /tmp)")
    parser.add_argument("--out", help=f"results folder (default {RESULTS})")
    parser.add_argument("--max-gb", type=float, default=2.0, help="largest scaling size (GB)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG figures")
    args = parser.parse_args(argv)
    mode_name = "smoke" if args.smoke else "quick" if args.quick else "full"
    max_bytes = int(args.max_gb * GB)
    folder = pick_folder(args.dir, 6 * GB if mode_name == "full" else 3 * GB if args.quick else 0)
    out = Path(args.out) if args.out else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    cfg = Config(mode_name, folder, max_bytes, log=lambda line: print(line, flush=True))
    info = machine(folder)
    print(f"machine: {describe(info)}; mode {mode_name}", flush=True)
    results: dict[str, Any] = {"machine": info, "mode": mode_name}
    started = time.perf_counter()
    seconds: dict[str, float] = {}
    for name in args.only or list(SECTIONS):
        section_start = time.perf_counter()
        results[name] = SECTIONS[name](cfg)
        seconds[name] = time.perf_counter() - section_start
    seconds["total"] = time.perf_counter() - started
    results["seconds"] = seconds
    info["loadavg_after"] = os.getloadavg()
    (out / "results.json").write_text(json.dumps(results, indent=1))
    if not args.no_plots:
        from benchmarks.plots import all_plots

        for path in all_plots(results, out):
            print(f"plot: {path}")
    print(
        f"results: {out / 'results.json'} ({seconds['total']:.0f} s: {', '.join(f'{k} {v:.0f}' for k, v in seconds.items())})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
