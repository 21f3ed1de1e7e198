"""PNG figures of a suite run's results (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

CONTENDERS = ("checkpointd", "torch.save", "safetensors", "dcp", "dcp_async")


def _save(fig: Any, path: Path) -> Path:
    """Lay out, write and close a figure; return where it went."""
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _median(series: dict[str, Any], name: str) -> float:
    value = series.get(name, {}).get("median")
    return float("nan") if value is None else float(value)


def _spread(series: dict[str, Any], name: str) -> tuple[float, float]:
    item = series.get(name, {})
    if item.get("median") is None:
        return 0.0, 0.0
    return item["median"] - item["min"], item["max"] - item["median"]


def large(results: dict[str, Any], out: Path) -> list[Path]:
    """One figure per state: blocked, durable, load (warm, cold), peak extra RSS per contender."""
    paths: list[Path] = []
    for index, (label, case) in enumerate(results.items()):
        series = case["series"]
        fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
        panels = [
            ("caller blocked (s)", "blocked", "memcpy"),
            ("until durable (s)", "durable", "raw"),
            ("load, page cache warm / cold (s)", "load", None),
        ]
        for ax, (title, key, floor) in zip(axes, panels, strict=False):
            if key == "load":
                names = [c for c in CONTENDERS if f"{c}.load_warm" in series]
                xs = range(len(names))
                warm = [_median(series, f"{c}.load_warm") for c in names]
                cold = [_median(series, f"{c}.load_cold") for c in names]
                ax.bar([x - 0.2 for x in xs], warm, 0.4, label="warm")
                ax.bar([x + 0.2 for x in xs], cold, 0.4, label="cold")
                ax.set_xticks(list(xs), names, rotation=30, ha="right")
                ax.legend(fontsize=8)
            else:
                names = [c for c in CONTENDERS if f"{c}.{key}" in series]
                values = [_median(series, f"{c}.{key}") for c in names]
                errors = list(zip(*[_spread(series, f"{c}.{key}") for c in names], strict=True))
                colors = ["tab:green" if c == "checkpointd" else "tab:gray" for c in names]
                ax.bar(names, values, yerr=errors, color=colors, capsize=3)
                floor_label = "memcpy floor" if floor == "memcpy" else "raw write+fsync"
                ax.axhline(
                    _median(series, floor or ""), color="tab:red", ls="--", label=floor_label
                )
                ax.tick_params(axis="x", rotation=30)
                ax.legend(fontsize=8)
            ax.set_title(title, fontsize=10)
        rss = case.get("peak_rss") or {}
        ax = axes[3]
        if rss:
            names = [c for c in CONTENDERS if c in rss]
            ax.bar(names, [rss[c]["extra"] / 1e9 for c in names], color="tab:purple")
            ax.axhline(case["nbytes"] / 1e9, color="tab:red", ls="--", label="state size")
            ax.tick_params(axis="x", rotation=30)
            ax.legend(fontsize=8)
        ax.set_title("peak extra RSS of a save (GB)", fontsize=10)
        fig.suptitle(f"{label}: median of interleaved repetitions, bars = min..max")
        paths.append(_save(fig, out / f"large_{index}.png"))
    return paths


def small(result: dict[str, Any], out: Path) -> Path:
    series = result["series"]
    names = ["memcpy", "checkpointd.blocked", "checkpointd.durable", "torch.save.durable"]
    labels = ["memcpy floor", "checkpointd\nblocked", "checkpointd\ndurable", "torch.save\n+fsync"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.bar(
        labels,
        [_median(series, n) for n in names],
        color=["tab:red", "tab:green", "tab:green", "tab:gray"],
    )
    ax.set_ylabel("seconds")
    ax.set_title(f"{result['count']} tensors of 1-64 KB ({result['nbytes'] / 1e9:.2f} GB)")
    return _save(fig, out / "small.png")


def training(result: dict[str, Any], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    keys = [
        ("step_idle", "no save"),
        ("step_during_save", "checkpointd\nsave"),
        ("step_during_thread_write", "bare thread\nwrite+fsync"),
        ("step_during_process_write", "child process\nwrite+fsync"),
    ]
    keys = [(k, label) for k, label in keys if result.get(k, {}).get("values")]
    data = [[v * 1e3 for v in result[k]["values"]] for k, _ in keys]
    ax.boxplot(data, tick_labels=[label for _, label in keys], showfliers=False)
    ax.set_ylabel("training step (ms)")
    ax.set_title(f"CPU training step times: slowdown {result['slowdown'] * 100:+.1f}% (median)")
    return _save(fig, out / "training.png")


def s3(result: dict[str, Any], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 3.8))
    names = list(result["mib_per_s"])
    colors = ["tab:green" if n.startswith("checkpointd") else "tab:gray" for n in names]
    ax.barh(names, [result["mib_per_s"][n] for n in names], color=colors)
    ax.set_xlabel("MiB/s to moto (median)")
    ax.set_title(f"S3 (moto server on 127.0.0.1), {result['nbytes'] / 2**20:.0f} MiB")
    return _save(fig, out / "s3.png")


def scaling(result: dict[str, Any], out: Path) -> Path:
    rows = result["rows"]
    sizes = [r["nbytes"] / 1e9 for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for key, label, style in (
        ("blocked", "checkpointd blocked", "o-"),
        ("memcpy", "memcpy floor", "x--"),
        ("durable", "checkpointd durable", "s-"),
        ("raw", "raw write+fsync", "x:"),
    ):
        ax.plot(sizes, [_median(r["series"], key) for r in rows], style, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("state size (GB)")
    ax.set_ylabel("seconds")
    ax.set_title("scaling (log-log; slope 1 = linear)")
    ax.legend(fontsize=8)
    return _save(fig, out / "scaling.png")


def all_plots(results: dict[str, Any], out: Path) -> list[Path]:
    """Draw every figure whose section is in ``results``; return the PNG paths."""
    paths: list[Path] = []
    if "large" in results:
        paths += large(results["large"], out)
    for name, draw in (("small", small), ("training", training), ("s3", s3), ("scaling", scaling)):
        if name in results:
            paths.append(draw(results[name], out))
    return paths
