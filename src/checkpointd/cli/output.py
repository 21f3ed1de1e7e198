"""How the ``checkpointd`` command line shows things: sizes, metrics, specs, shards, and
the progress bar of long reads (on stderr, so stdout stays results only)."""

from __future__ import annotations

import json
import sys
from typing import Any, Literal, TextIO

__all__ = [
    "metrics_text",
    "progress_bar",
    "say",
    "shards_text",
    "size_text",
    "spec_text",
]


def metrics_text(metrics: dict[str, Any]) -> str:
    return " ".join(
        f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()
    )


def size_text(nbytes: float) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def spec_text(entry: dict[str, Any]) -> str:
    """``kind module.qualname(args) over other`` for one manifest spec."""
    shown = [
        *map(json.dumps, entry["args"]),
        *(f"{k}={json.dumps(v)}" for k, v in entry["kwargs"].items()),
    ]
    over = f" over {entry['of']}" if entry["of"] else ""
    return f"{entry['kind']} {entry['module']}.{entry['qualname']}({', '.join(shown)}){over}"


def shards_text(shards: list[dict[str, Any]] | None) -> str:
    """``  2 shards: rank 0 [0:12], rank 1 [12:24]`` for a sharded tensor (``blob [..]``
    for a shard stored as a shared blob, whose rank is not recorded), else ""."""
    if not shards:
        return ""
    shown = [
        ("blob [" if s["rank"] is None else f"rank {s['rank']} [")
        + ", ".join(f"{o}:{o + n}" for o, n in zip(s["offsets"], s["shape"], strict=True))
        + "]"
        for s in shards[:4]
    ]
    more = f", ... ({len(shards) - 4} more)" if len(shards) > 4 else ""
    return f"  {len(shards)} shard{'' if len(shards) == 1 else 's'}: {', '.join(shown)}{more}"


def progress_bar(total: int, mode: Literal["auto", "always", "never"], stream: TextIO) -> Any:
    """A tqdm byte counter on ``stream`` (stderr): "auto" shows it once the work has
    taken a second, "always" from the start, "never" not at all. On a terminal it
    redraws in place; elsewhere at most every 5 s (unless "always")."""
    from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]

    tty = stream.isatty()
    return tqdm(
        total=total,
        desc="verify",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=stream,
        disable=mode == "never",
        delay=0.0 if mode == "always" else 1.0,
        mininterval=0.0 if mode == "always" else (0.2 if tty else 5.0),
        dynamic_ncols=tty,
    )


def say(bar: Any, line: str) -> None:
    """Print ``line`` on stdout; around the bar (cleared, then redrawn) once it is shown.

    tqdm.write would redraw a bar that is still inside its delay, and that bar is
    then never finished with a newline.
    """
    shown = not bar.disable and bar.last_print_t >= bar.start_t + bar.delay
    if shown:
        bar.write(line, file=sys.stdout)
        sys.stdout.flush()
    else:
        print(line, flush=True)
