"""Peak extra memory of one contender's save, measured alone in this (child) process.

``python -m benchmarks.rss CONTENDER --layers L --d D [--optimizer] --dir FOLDER``
builds the state, resets the kernel's peak-RSS mark (``/proc/self/clear_refs``),
saves twice (checkpointd's staging buffer is allocated by the first save and
reused by the second, as in training), and prints one JSON object:
``{"contender", "state_bytes", "rss_before", "peak", "extra"}`` (bytes).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

from benchmarks.common import nbytes_of


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> None:
    """Make VmHWM (peak RSS) equal the current RSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def main(argv: list[str] | None = None) -> int:
    from benchmarks.bench_save import CONTENDERS, model_state, process_group

    parser = argparse.ArgumentParser()
    parser.add_argument("contender", choices=sorted(CONTENDERS))
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--optimizer", action="store_true")
    parser.add_argument("--dir", required=True)
    args = parser.parse_args(argv)
    state = model_state(args.optimizer, layers=args.layers, d=args.d)
    folder = Path(args.dir)
    with process_group(folder):
        gc.collect()
        reset_peak()
        before = _status("VmRSS")
        # checkpointd's constructor takes the first save (allocating its staging buffer).
        contender = CONTENDERS[args.contender](state, folder)
        contender.clear()
        for rep in range(2):
            contender.save(rep)
            contender.clear()
        peak = _status("VmHWM")
        contender.close()
    result = {
        "contender": args.contender,
        "state_bytes": nbytes_of(state),
        "rss_before": before,
        "peak": peak,
        "extra": peak - before,
    }
    json.dump(result, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
