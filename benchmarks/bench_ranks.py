"""Many ranks with FSDP2 on CPU: checkpointd vs torch.distributed.checkpoint, side by side.

Run: ``python -m benchmarks.bench_ranks [--mb 64 --reps 3 --worlds 2 4]``.
For each world size the same ranks, in one run, save the same FSDP2 model and
AdamW state (about 3 x MB megabytes in all) with ``memcpy`` (the floor: a copy of
each rank's own shards), ``checkpointd`` and DCP ``async_save`` (thread and
process mode), then restore it (checkpointd.restore vs dcp.load); then 3 ranks
restore what 2 saved (resharding). Prints per-rank blocked time, time until
durable (the slowest rank), restore time and bytes stored, with the ratios the
issue's goals are stated in; writes ``benchmarks/results/ranks.json`` and
``ranks.png`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from tests.support.launch import run_ranks

RESULTS = Path(__file__).parent / "results"
SAVES = ("memcpy", "checkpointd", "dcp_thread", "dcp_process")


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _one_step_bytes(root: Path) -> int:
    """Bytes of the newest checkpoint under ``root`` (a DCP folder or a checkpointd root)."""
    steps = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: int(p.name))
    return _bytes(steps[-1])


def _summary(reports: list[dict[str, list[float]]]) -> dict[str, float]:
    """Per measure: the median over repetitions of the slowest rank."""
    keys = reports[0].keys()
    return {
        key: statistics.median(max(r[key][i] for r in reports) for i in range(len(reports[0][key])))
        for key in keys
    }


def run(worlds: list[int], mb: float, reps: int, folder: Path) -> dict[str, Any]:
    results: dict[str, Any] = {"mb": mb, "reps": reps, "worlds": {}}
    for world in worlds:
        work = folder / f"w{world}"
        out = work / "out"
        reports = run_ranks(
            "benchmarks.rank_worker",
            [str(world), str(mb), str(reps), str(work), str(out)],
            out,
            world,
            timeout=1800,
        )
        if any(r is None for r in reports):
            raise SystemExit(f"a rank failed: see {out}/stderr*.txt")
        summary = _summary(reports)  # type: ignore[arg-type]
        summary["checkpointd.bytes"] = _one_step_bytes(work / "checkpointd")
        summary["dcp.bytes"] = _one_step_bytes(work / "dcp" / "thread")
        results["worlds"][str(world)] = summary
        if world == 2 and 3 not in worlds:
            out3 = work / "out3"
            again = run_ranks(
                "benchmarks.rank_worker",
                ["2", str(mb), str(reps), str(work), str(out3)],
                out3,
                3,
                timeout=1800,
            )
            if any(r is None for r in again):
                raise SystemExit(f"a rank failed: see {out3}/stderr*.txt")
            results["reshard_2_to_3"] = _summary(again)  # type: ignore[arg-type]
    return results


def report(results: dict[str, Any]) -> list[str]:
    lines = [f"state: {results['mb']:g} MB of parameters + AdamW ({results['reps']} reps)"]
    for world, s in results["worlds"].items():
        lines.append(f"\n{world} ranks (median over reps of the slowest rank, seconds)")
        lines.append(f"  {'method':<12} {'blocked':>9} {'durable':>9}")
        for name in SAVES:
            durable = s.get(f"{name}.durable")
            shown = f"{durable:9.3f}" if durable is not None else f"{'-':>9}"
            lines.append(f"  {name:<12} {s[f'{name}.blocked']:9.3f} {shown}")
        lines.append(
            f"  restore: checkpointd {s['checkpointd.read.restore']:.3f}, dcp.load {s['dcp.restore']:.3f}"
        )
        lines.append(
            f"  bytes stored per checkpoint: checkpointd {s['checkpointd.bytes']:,}, "
            f"DCP {s['dcp.bytes']:,}"
        )
        lines.append(
            "  ratios: blocked/memcpy "
            f"{s['checkpointd.blocked'] / s['memcpy.blocked']:.2f} (goal <= 1.5); "
            f"durable/dcp_thread {s['checkpointd.durable'] / s['dcp_thread.durable']:.2f} "
            f"(goal <= 1); restore/dcp.load "
            f"{s['checkpointd.read.restore'] / s['dcp.restore']:.2f} (goal <= 1)"
        )
    if "reshard_2_to_3" in results:
        r = results["reshard_2_to_3"]
        lines.append(
            f"\nresharding 2 -> 3 ranks: checkpointd.restore {r['checkpointd.read.restore']:.3f} s, "
            f"dcp.load {r['dcp.restore']:.3f} s, ratio "
            f"{r['checkpointd.read.restore'] / r['dcp.restore']:.2f}"
        )
    return lines


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = list(results["worlds"])
    fig, axes = plt.subplots(1, len(worlds), figsize=(6 * len(worlds), 3.8), squeeze=False)
    for ax, world in zip(axes[0], worlds, strict=True):
        s = results["worlds"][world]
        names = ["checkpointd", "dcp_thread", "dcp_process"]
        x = range(len(names))
        ax.bar([i - 0.27 for i in x], [s[f"{n}.blocked"] for n in names], 0.27, label="blocked")
        ax.bar(list(x), [s[f"{n}.durable"] for n in names], 0.27, label="durable")
        restores = [s["checkpointd.read.restore"], s["dcp.restore"], s["dcp.restore"]]
        ax.bar([i + 0.27 for i in x], restores, 0.27, label="restore (dcp.load for DCP)")
        ax.axhline(s["memcpy.blocked"], color="gray", linestyle=":", label="memcpy of own shards")
        ax.set_xticks(list(x), names)
        ax.set_ylabel("seconds (slowest rank)")
        ax.set_title(f"FSDP2, {world} ranks, {results['mb']:g} MB params + AdamW")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=64, help="parameter megabytes (float32)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out", help=f"results folder (default {RESULTS})")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="checkpointd-ranks-"))
    try:
        results = run(args.worlds, args.mb, args.reps, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    for line in report(results):
        print(line)
    (out / "ranks.json").write_text(json.dumps(results, indent=1))
    if not args.no_plot:
        plot(results, out / "ranks.png")
        print(f"plot: {out / 'ranks.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
