"""The many-rank stall: where a 2-rank FSDP2 ``save()`` blocks, phase by phase.

Run: ``python -m benchmarks.bench_stall [--mb 64 --reps 9 --world 2]`` (also the
``stall`` section of ``python -m benchmarks.run``).

Each rank (benchmarks/stall_worker.py) saves rank_worker's FSDP2 MLP and AdamW
state with the group (``ranked``), and, in the same run, interleaved, the same
shards as plain tensors with a writer of its own (``local``: the single-process
capture of the same bytes), and copies them on one thread (``memcpy``). Prints the
medians of each phase per save kind (the slowest rank's), and per rank the median
of ``ranked / local`` over the repetitions (the goal: at most 1.2), of ``ranked /
memcpy`` (the figure of the earlier rounds) and of the CPU seconds the two saves
took (on a busy machine the blocked seconds wait for cores too; the CPU seconds do
not).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.common import work_dir
from benchmarks.stall_worker import PHASES
from tests.support.launch import run_ranks

if TYPE_CHECKING:
    from benchmarks.sections import Config

RESULTS = Path(__file__).parent / "results"
KINDS = ("ranked", "local", "memcpy")
GOAL = 1.2


def run(world: int, mb: float, reps: int, folder: Path) -> dict[str, Any]:
    """Run the ranks once; per kind the median of each phase (slowest rank), per rank the
    paired ratios."""
    out = folder / "out"
    reports = run_ranks(
        "benchmarks.stall_worker",
        [str(mb), str(reps), str(folder), str(out)],
        out,
        world,
        timeout=1200,
    )
    if any(r is None for r in reports):
        raise SystemExit(f"a rank failed: see {out}/stderr*.txt")
    ranks: list[dict[str, Any]] = reports  # type: ignore[assignment]
    phases = {
        kind: {
            phase: max(statistics.median(rep[phase] for rep in r[kind]) for r in ranks)
            for phase in (*PHASES, "blocked", "cpu")
            if kind != "memcpy" or phase in ("blocked", "cpu")
        }
        for kind in KINDS
    }
    ratios = [
        {
            "ranked/local": statistics.median(
                a["blocked"] / b["blocked"] for a, b in zip(r["ranked"], r["local"], strict=True)
            ),
            "ranked/memcpy": statistics.median(
                a["blocked"] / b["blocked"] for a, b in zip(r["ranked"], r["memcpy"], strict=True)
            ),
            "cpu ranked/local": statistics.median(
                a["cpu"] / b["cpu"] for a, b in zip(r["ranked"], r["local"], strict=True)
            ),
        }
        for r in ranks
    ]
    return {
        "mb": mb,
        "reps": reps,
        "world": world,
        "shard_bytes": max(r["nbytes"][0]["shards"] for r in ranks),
        "phases": phases,
        "ratios": ratios,
        "worst": max(r["ranked/local"] for r in ratios),
        "raw": ranks,
    }


def report(results: dict[str, Any]) -> list[str]:
    """The breakdown table and the ratios, as printed."""
    phases = results["phases"]
    lines = [
        f"{results['world']}-rank FSDP2, {results['mb']:g} MB of parameters + AdamW: "
        f"{results['shard_bytes'] / 2**20:.0f} MiB of shards per rank, {results['reps']} reps "
        "(ms, median of the slowest rank)",
        f"  {'phase':<11}{'ranked':>9}{'local':>9}",
    ]
    for phase in (*PHASES, "blocked", "cpu"):
        lines.append(
            f"  {phase:<11}{phases['ranked'][phase] * 1e3:9.2f}{phases['local'][phase] * 1e3:9.2f}"
        )
    lines.append(f"  {'memcpy':<11}{phases['memcpy']['blocked'] * 1e3:9.2f}")
    for rank, r in enumerate(results["ratios"]):
        lines.append(
            f"  rank {rank}: ranked/local {r['ranked/local']:.2f} (goal <= {GOAL}), "
            f"ranked/memcpy {r['ranked/memcpy']:.2f}, CPU ranked/local {r['cpu ranked/local']:.2f}"
        )
    return lines


def stall(cfg: Config) -> dict[str, Any]:
    """The ``stall`` section of ``benchmarks.run``: 2 ranks, 64 MB (1 MB in smoke mode)."""
    mb, reps = (1.0, 1) if cfg.smoke else (64.0, 5 if cfg.quick else 9)
    with work_dir(cfg.folder, "stall") as folder:
        results = run(2, mb, reps, folder)
    for line in report(results):
        cfg.log(f"[stall] {line}")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=64, help="parameter megabytes (float32)")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--out", help=f"results folder (default {RESULTS})")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="checkpointd-stall-"))
    try:
        results = run(args.world, args.mb, args.reps, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    for line in report(results):
        print(line)
    (out / "stall.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
