"""Incremental checkpoints against full ones, side by side in one run.

Two states, each saved ``--saves`` times by a full writer and by an
``incremental=True`` writer (both ``keep_last=2``, on local disk), alternating
save by save (who goes first alternates) so both see the same machine:

- **lora**: a frozen base of ``--base-mb`` MB (tensors of at most 64 MB) plus
  LoRA adapters of ``--adapter-mb`` MB and their AdamW state (2x), which change
  every save. Goals: bytes written per save <= 2x the changed bytes plus the
  manifest, durable time <= 0.1x the full save.
- **changing**: every tensor of ``--changing-mb`` MB changes every save. Goal:
  durable time with ``incremental=True`` <= 1.1x without.
- **lora-ranks**: the lora case as an FSDP2 job of ``--ranks`` (2) gloo processes:
  a frozen base of ``--base-mb`` MB sharded over the ranks, adapters of
  ``--adapter-mb`` MB trained by AdamW between saves
  (benchmarks/incremental_rank_worker.py). Goal: bytes written per save <= 1.1x
  the changed bytes (the adapters and their AdamW state).

Prints per save the bytes written and the durable time (save() to committed),
then the medians (first save excluded: it writes everything either way), the
ratios and the storage the root holds at the end.

    PYTHONPATH=src python -m benchmarks.bench_incremental [--base-mb 1024] [--saves 10]
    PYTHONPATH=src python -m benchmarks.bench_incremental --smoke      # seconds (CI)
    PYTHONPATH=src python -m benchmarks.bench_incremental --cases lora-ranks --ranks 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import checkpointd
from benchmarks.common import pick_folder, work_dir

MB = 10**6


def _tensors(total_mb: float, largest_mb: float, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """float32 tensors of ``total_mb`` MB, none larger than ``largest_mb``."""
    out: dict[str, torch.Tensor] = {}
    left = int(total_mb * MB) // 4
    largest = max(1, int(largest_mb * MB) // 4)
    i = 0
    while left > 0:
        n = min(left, largest)
        out[f"t{i}"] = torch.randn(n, generator=gen)
        left -= n
        i += 1
    return out


def lora_state(base_mb: float, adapter_mb: float) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """(state, the tensors a training step changes): a frozen base, adapters, AdamW state."""
    gen = torch.Generator().manual_seed(0)
    base = _tensors(base_mb, 64, gen)
    adapters = _tensors(adapter_mb, 1, gen)
    exp_avg = {k: torch.randn(v.shape, generator=gen) for k, v in adapters.items()}
    exp_avg_sq = {k: torch.rand(v.shape, generator=gen) for k, v in adapters.items()}
    state = {
        "model": {"base": base, "lora": adapters},
        "optimizer": {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "step": torch.tensor(0)},
    }
    changing = [*adapters.values(), *exp_avg.values(), *exp_avg_sq.values()]
    return state, changing


def changing_state(total_mb: float) -> tuple[dict[str, Any], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    model = _tensors(total_mb, 64, gen)
    return {"model": model}, list(model.values())


def _du(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def run_case(
    name: str,
    state: dict[str, Any],
    changing: list[torch.Tensor],
    *,
    saves: int,
    folder: Path,
    log: Any,
) -> dict[str, Any]:
    """Save ``state`` ``saves`` times with a full and an incremental writer, alternating."""
    changed_bytes = sum(t.numel() * t.element_size() for t in changing)
    rows: dict[str, list[dict[str, float]]] = {"full": [], "incremental": []}
    roots = {kind: folder / f"{name}-{kind}" for kind in rows}
    writers = {
        kind: checkpointd.CheckpointWriter(str(root), keep_last=2, incremental=kind != "full")
        for kind, root in roots.items()
    }
    try:
        for step in range(1, saves + 1):
            for t in changing:
                t.add_(0.001)  # a training step: every changing tensor gets new bytes
            # Alternate who goes first, so neither always follows the other's writeback.
            order = list(writers.items())
            for kind, writer in order if step % 2 else order[::-1]:
                started = time.perf_counter()
                handle = writer.save(step, state)
                info = handle.result()
                durable = time.perf_counter() - started
                rows[kind].append(
                    {
                        "step": step,
                        "written": info.written_nbytes,
                        "referenced": info.referenced_nbytes,
                        "blocked_s": handle.blocked_seconds or 0.0,
                        "durable_s": durable,
                    }
                )
            f, i = rows["full"][-1], rows["incremental"][-1]
            log(
                f"  {name} save {step:>2}: full {f['written'] / MB:9.1f} MB {f['durable_s']:7.3f} s"
                f" | incremental {i['written'] / MB:9.1f} MB {i['durable_s']:7.3f} s"
                f" (references {i['referenced'] / MB:.1f} MB)"
            )
    finally:
        for writer in writers.values():
            writer.close()
    later = slice(1, None) if saves > 1 else slice(None)
    summary: dict[str, Any] = {"changed_bytes_per_save": changed_bytes, "rows": rows}
    for kind, kind_rows in rows.items():
        summary[kind] = {
            "written_median": statistics.median(r["written"] for r in kind_rows[later]),
            "durable_median_s": statistics.median(r["durable_s"] for r in kind_rows[later]),
            "blocked_median_s": statistics.median(r["blocked_s"] for r in kind_rows[later]),
            "storage_bytes": _du(roots[kind]),
        }
    summary["durable_ratio"] = (
        summary["incremental"]["durable_median_s"] / summary["full"]["durable_median_s"]
    )
    summary["written_ratio"] = (
        summary["incremental"]["written_median"] / summary["full"]["written_median"]
    )
    return summary


def run_ranked_case(
    base_mb: float, adapter_mb: float, *, ranks: int, saves: int, folder: Path, log: Any
) -> dict[str, Any]:
    """The lora case as an FSDP2 job of ``ranks`` gloo processes; every rank reports the
    same manifests, so rank 0's rows stand for the job."""
    from tests.support.launch import run_ranks

    out = folder / "lora-ranks-out"
    args = [str(base_mb), str(adapter_mb), str(saves), str(folder / "lora-ranks"), str(out)]
    reports = run_ranks("benchmarks.incremental_rank_worker", args, out, ranks, timeout=3600)
    if any(r is None for r in reports):
        raise SystemExit(f"a rank failed: see {out}/stderr*.txt")
    first = reports[0]
    assert first is not None
    rows = first["rows"]
    for f, i in zip(rows["full"], rows["incremental"], strict=True):
        log(
            f"  lora-ranks save {f['step']:>2}: full {f['written'] / MB:9.1f} MB "
            f"{f['durable_s']:7.3f} s | incremental {i['written'] / MB:9.1f} MB "
            f"{i['durable_s']:7.3f} s (references {i['referenced'] / MB:.1f} MB)"
        )
    later = slice(1, None) if saves > 1 else slice(None)
    summary: dict[str, Any] = {
        "ranks": ranks,
        "changed_bytes_per_save": first["changed_bytes_per_save"],
        "rows": rows,
    }
    for kind, kind_rows in rows.items():
        summary[kind] = {
            "written_median": statistics.median(r["written"] for r in kind_rows[later]),
            "durable_median_s": statistics.median(r["durable_s"] for r in kind_rows[later]),
            "storage_bytes": _du(folder / "lora-ranks" / kind),
        }
    return summary


def report(results: dict[str, Any], log: Any) -> None:
    """Log the medians side by side, their ratios and the goals."""
    log("")
    log(f"{'':<34}{'full':>12}{'incremental':>14}{'ratio':>8}")
    rows = (
        ("lora", "written per save (MB)", "written_median", MB),
        ("lora", "durable per save (s)", "durable_median_s", 1),
        ("lora", "blocked per save (s)", "blocked_median_s", 1),
        ("lora", "storage at the end (MB)", "storage_bytes", MB),
        ("changing", "durable per save (s)", "durable_median_s", 1),
        ("changing", "written per save (MB)", "written_median", MB),
        ("lora-ranks", "written per save (MB)", "written_median", MB),
        ("lora-ranks", "durable per save (s)", "durable_median_s", 1),
        ("lora-ranks", "storage at the end (MB)", "storage_bytes", MB),
    )
    for case_name, label, key, unit in rows:
        if case_name not in results:
            continue
        case = results[case_name]
        full, inc = case["full"][key] / unit, case["incremental"][key] / unit
        title = f"{case_name}: {label}"
        log(f"{title:<34}{full:>12.3f}{inc:>14.3f}{inc / full if full else 0:>8.3f}")
    goals = []
    if "lora" in results:
        lora = results["lora"]
        written = lora["incremental"]["written_median"] / lora["changed_bytes_per_save"]
        goals.append(f"lora written {written:.2f}x the changed bytes (<= 2x + manifest)")
        goals.append(f"lora durable {lora['durable_ratio']:.3f}x full (<= 0.1)")
    if "changing" in results:
        goals.append(f"changing durable {results['changing']['durable_ratio']:.3f}x full (<= 1.1)")
    if "lora-ranks" in results:
        ranked = results["lora-ranks"]
        written = ranked["incremental"]["written_median"] / ranked["changed_bytes_per_save"]
        goals.append(
            f"lora-ranks ({ranked['ranks']} ranks) written {written:.3f}x the changed bytes "
            f"({ranked['incremental']['written_median']:,} of "
            f"{ranked['changed_bytes_per_save']:,}; <= 1.1)"
        )
    log("goals: " + "; ".join(goals))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-mb", type=float, default=1024, help="frozen base (MB)")
    parser.add_argument("--adapter-mb", type=float, default=8, help="LoRA adapters (MB)")
    parser.add_argument("--changing-mb", type=float, default=512, help="all-changing state (MB)")
    parser.add_argument("--saves", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 3 saves (CI)")
    parser.add_argument("--dir", help="folder to write in (default $CHECKPOINTD_BENCH_DIR or /tmp)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the lora-ranks case")
    parser.add_argument(
        "--cases",
        nargs="+",
        choices=("lora", "changing", "lora-ranks"),
        help="default: all three (--smoke: lora and changing)",
    )
    parser.add_argument("--plot", help="also draw the figures into this PNG file")
    args = parser.parse_args(argv)
    if args.smoke:
        args.base_mb, args.adapter_mb, args.changing_mb, args.saves = 8, 0.5, 4, 3
    if args.cases is None:
        args.cases = ["lora", "changing"] + ([] if args.smoke else ["lora-ranks"])
    need = int((4 * 2 * args.base_mb + 3 * 2 * args.changing_mb) * MB)
    folder = pick_folder(args.dir, need)

    def log(line: str) -> None:
        print(line, flush=True)

    log(
        f"incremental vs full: lora base {args.base_mb:g} MB + adapters {args.adapter_mb:g} MB "
        f"(+2x AdamW), changing {args.changing_mb:g} MB, {args.saves} saves, keep_last=2, "
        f"in {folder}, {os.cpu_count()} CPUs"
    )
    results: dict[str, Any] = {"args": vars(args)}
    with work_dir(folder, "incremental") as work:
        if "lora" in args.cases:
            state, changing = lora_state(args.base_mb, args.adapter_mb)
            results["lora"] = run_case(
                "lora", state, changing, saves=args.saves, folder=work, log=log
            )
            del state, changing
        if "changing" in args.cases:
            state, changing = changing_state(args.changing_mb)
            results["changing"] = run_case(
                "changing", state, changing, saves=args.saves, folder=work, log=log
            )
            del state, changing
        if "lora-ranks" in args.cases:
            results["lora-ranks"] = run_ranked_case(
                args.base_mb,
                args.adapter_mb,
                ranks=args.ranks,
                saves=args.saves,
                folder=work,
                log=log,
            )
    report(results, log)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        log(f"plot: {plot(results, Path(args.plot))}")
    return 0


def plot(results: dict[str, Any], path: Path) -> Path:
    """Per save: MB written and durable seconds, full against incremental, for each case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [name for name in ("lora", "changing", "lora-ranks") if name in results]
    fig, axes = plt.subplots(len(cases), 2, figsize=(10, 3.2 * len(cases)), squeeze=False)
    for row, name in zip(axes, cases, strict=True):
        for kind, style in (("full", "o-"), ("incremental", "s-")):
            rows = results[name]["rows"][kind]
            steps = [r["step"] for r in rows]
            row[0].plot(steps, [r["written"] / MB for r in rows], style, label=kind)
            row[1].plot(steps, [r["durable_s"] for r in rows], style, label=kind)
        if name != "changing":
            row[0].set_yscale("log")
        else:
            row[0].set_ylim(bottom=0)
        row[1].set_ylim(bottom=0)
        row[0].set_title(f"{name}: MB written per save")
        row[1].set_title(f"{name}: durable seconds per save")
        for ax in row:
            ax.set_xlabel("save")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
