"""What the framework benchmarks (Lightning, transformers, torchtitan) share: the median
of repeated training runs with periodic saves, and the table that compares them with the
framework's own saving. Each run is a dict with its total seconds under some key and the
seconds each save blocked the loop under ``"blocked"``."""

from __future__ import annotations

import statistics
from typing import Any


def summarize(
    runs: dict[str, list[dict[str, Any]]], total: str, key: str
) -> dict[str, dict[str, float]]:
    """Per kind: the median of ``run[total]`` (as ``key``), of every blocked save in ms,
    and of the number of saves per run."""
    return {
        kind: {
            key: statistics.median(run[total] for run in rs),
            "blocked_ms": 1000 * statistics.median(b for run in rs for b in run["blocked"]),
            "saves": statistics.median(len(run["blocked"]) for run in rs),
        }
        for kind, rs in runs.items()
    }


def print_table(
    summary: dict[str, dict[str, float]],
    *,
    key: str,
    base: str,
    first_column: str,
    names: dict[str, str],
) -> None:
    """One row per kind: the total and the blocked time per save, each also as a ratio to
    the ``base`` kind's."""
    label = key.removesuffix("_s") + " s"
    width = max(8, len(label) + 1)
    print(f"{first_column:<22}{label:>{width}}{'x':>7}{'blocked/save ms':>17}{'x':>7}{'saves':>7}")
    reference = summary[base]
    for kind, row in summary.items():
        print(
            f"{names[kind]:<22}{row[key]:>{width}.2f}{row[key] / reference[key]:>7.2f}"
            f"{row['blocked_ms']:>17.1f}{row['blocked_ms'] / reference['blocked_ms']:>7.2f}"
            f"{row['saves']:>7.0f}"
        )
