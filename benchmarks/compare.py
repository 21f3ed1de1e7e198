"""Every row of the suite, before and after: ``python -m benchmarks.compare --before REV``.

Runs ``benchmarks.run`` once per section and per side, the two sides alternating
(before, after; then after, before; ...), so that a machine whose load drifts
treats both alike. Both sides run *this* tree's benchmark code; only the library
differs: ``REV``'s ``src/`` (extracted with ``git archive``) or this tree's, put
first on ``PYTHONPATH``. A section the old library cannot run (an API it lacks)
is reported as such, not dropped.

Prints one table: each row's figure before and after (medians over ``--rounds``)
and after / before, and writes it as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.sections import SECTIONS

REPO = Path(__file__).resolve().parent.parent

# Leaves that describe a row rather than measure it.
NOT_FIGURES = frozenset(
    {"min", "max", "goal", "nbytes", "state_bytes", "rss_before", "peak", "count", "shares"}
    | {"mb", "reps", "world", "shard_bytes"}
)


def rows(section: str, result: Any) -> Iterator[tuple[str, float]]:
    """Yield ``(row name, figure)`` for every measured figure of one section's results.

    A series counts by its median; a ratio listed as ``{label, value}`` by its label.
    """

    def walk(node: Any, path: tuple[str, ...]) -> Iterator[tuple[str, float]]:
        if isinstance(node, dict):
            if "label" in node and isinstance(node.get("value"), (int, float)):
                yield "/".join((*path[:-1], str(node["label"]))), float(node["value"])
                return
            for key, value in node.items():
                if key in ("machine", "values", "raw") or key in NOT_FIGURES:
                    continue
                yield from walk(value, (*path, str(key)))
        elif isinstance(node, list):
            for index, value in enumerate(node):
                yield from walk(value, (*path, str(index)))
        elif isinstance(node, (int, float)) and not isinstance(node, bool):
            name = "/".join(part for part in path if part != "series")
            yield name.removesuffix("/median"), float(node)

    yield from walk(result, (section,))


def extract_source(rev: str, into: Path) -> Path:
    """Extract ``rev``'s ``src/`` from this repository into ``into``; return that ``src``."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", rev, "src"],
        check=True,
        capture_output=True,
    ).stdout
    tar_path = into / "src.tar"
    tar_path.write_bytes(archive)
    with tarfile.open(tar_path) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def run_section(section: str, src: Path, mode: str, folder: str | None, out: Path) -> Any:
    """Run one section with the library at ``src``; its results, or ``None`` if it failed."""
    command = [sys.executable, "-m", "benchmarks.run", "--only", section]
    command += [] if mode == "full" else [f"--{mode}"]
    command += ["--no-plots", "--out", str(out)] + (["--dir", folder] if folder else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(REPO)])}
    done = subprocess.run(command, check=False, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
        print(f"  {section} failed ({done.returncode}): {' '.join(tail)}", flush=True)
        return None
    return json.loads((out / "results.json").read_text())[section]


def compare(
    before_src: Path, sections: list[str], *, mode: str, rounds: int, folder: str | None, work: Path
) -> dict[str, dict[str, list[float]]]:
    """Each row's figures per side, the sides alternating per section and round."""
    after_src = REPO / "src"
    figures: dict[str, dict[str, list[float]]] = {}
    turn = 0
    for round_index in range(rounds):
        for section in sections:
            sides = [("before", before_src), ("after", after_src)]
            for side, src in sides if turn % 2 == 0 else sides[::-1]:
                started = time.perf_counter()
                out = work / f"{side}-{section}-{round_index}"
                result = run_section(section, src, mode, folder, out)
                seconds = time.perf_counter() - started
                load = os.getloadavg()[0]
                print(f"round {round_index + 1} {section} {side}: {seconds:.0f} s, load {load:.1f}")
                for name, value in rows(section, result) if result is not None else ():
                    figures.setdefault(name, {"before": [], "after": []})[side].append(value)
            turn += 1
    return figures


def table(figures: dict[str, dict[str, list[float]]]) -> list[dict[str, Any]]:
    """One row per figure: medians per side and after / before (``None`` where a side lacks it)."""
    out = []
    for name, sides in figures.items():
        before = statistics.median(sides["before"]) if sides["before"] else None
        after = statistics.median(sides["after"]) if sides["after"] else None
        change = after / before if before and after is not None else None
        out.append({"row": name, "before": before, "after": after, "after/before": change})
    return out


def print_table(rows_: list[dict[str, Any]]) -> None:
    """Print the table, one line per row."""

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.4g}"

    width = max((len(r["row"]) for r in rows_), default=10)
    print(f"{'row':<{width}}  {'before':>10}  {'after':>10}  {'after/before':>12}")
    for r in rows_:
        change = r["after/before"]
        print(
            f"{r['row']:<{width}}  {cell(r['before']):>10}  {cell(r['after']):>10}"
            f"  {'-' if change is None else f'{change:.2f}x':>12}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the commit to compare against")
    parser.add_argument("--mode", choices=("smoke", "quick", "full"), default="quick")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each section per side")
    parser.add_argument("--only", nargs="+", choices=sorted(SECTIONS), help="these sections")
    parser.add_argument("--dir", help="folder the benchmarks write in")
    parser.add_argument("--out", help="write the table here as JSON")
    args = parser.parse_args(argv)
    sections = args.only or list(SECTIONS)
    with tempfile.TemporaryDirectory(prefix="checkpointd-compare-") as tmp:
        work = Path(tmp)
        before_src = extract_source(args.before, work)
        figures = compare(
            before_src, sections, mode=args.mode, rounds=args.rounds, folder=args.dir, work=work
        )
    result = table(figures)
    print(f"\nbefore {args.before}, after this tree; {args.mode}, {args.rounds} round(s)")
    print_table(result)
    if args.out:
        Path(args.out).write_text(json.dumps({"before": args.before, "rows": result}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
