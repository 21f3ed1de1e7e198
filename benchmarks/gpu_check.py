"""The CUDA paths on a real GPU in one run: every test marked ``cuda``, then the GPU
benchmark (``benchmarks/gpu_figures.py``), a JSON of figures and a verdict.

    benchmarks/gpu_check.sh [--gb 4] [--budget-s 480] [--out FILE]   # installs, then this
    python -m benchmarks.gpu_check [--gb 4] [--budget-s 480] [--out FILE] [--smoke]

Goals (issue 37), judged only on a CUDA device: ``save()`` blocked at most 1.2x a
``torch.cuda`` pinned device-to-host copy of the same bytes; ``staging="overlapped"``
blocked at most 0.1x blocking's; ``restore`` into CUDA tensors at most 0.8x
``torch.load(map_location="cuda")`` + ``load_state_dict``; every CUDA test passing.
DCP ``async_save`` with its pinned stager and the service are measured beside them.
Without CUDA it still runs end to end: the CUDA tests report skipped, the benchmark runs
on CPU at toy size, and each goal reads "skipped: no CUDA device"; exit 0 unless a test
failed. On a device, the exit status is 1 if a goal is missed or a test fails.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks import gpu_figures
from benchmarks.common import GB, REPO, machine, repo_env

NO_CUDA = "skipped: no CUDA device"
# (name, what is measured, numerator series, denominator series, at most)
GOALS = (
    ("save_blocked", "save() blocked / pinned D2H copy", "blocking.blocked", "d2h.pinned", 1.2),
    (
        "overlapped_blocked",
        'staging="overlapped" blocked / blocking',
        "overlapped.blocked",
        "blocking.blocked",
        0.1,
    ),
    (
        "restore_cuda",
        "restore into CUDA / torch.load + load_state_dict",
        "restore.checkpointd",
        "restore.torch",
        0.8,
    ),
)
# Reported beside the goals: (label, numerator series, denominator series).
REPORTED = (
    ("overlapped staged / blocking blocked", "overlapped.staged", "blocking.blocked"),
    ("durable: overlapped / blocking", "overlapped.durable", "blocking.durable"),
    ("DCP async_save blocked / checkpointd blocking", "dcp.blocked", "blocking.blocked"),
    ("DCP async_save blocked / checkpointd overlapped", "dcp.blocked", "overlapped.blocked"),
    ("DCP staged / checkpointd overlapped staged", "dcp.staged", "overlapped.staged"),
    ("durable: DCP / checkpointd blocking", "dcp.durable", "blocking.durable"),
    ("service blocked / in-process blocking", "service.blocked", "blocking.blocked"),
    ("durable: service / in-process", "service.durable", "blocking.durable"),
    ("restore from the service / torch.load", "restore.service", "restore.torch"),
    ("pinned D2H per tensor / one copy", "d2h.pinned", "d2h.single"),
)


def cuda_test_files() -> list[Path]:
    """The test files that mark a test ``cuda`` (a line ``@pytest.mark.cuda``; every test
    that needs CUDA has one, tests/unit/test_cuda_marks.py checks): collecting only those
    keeps the run short; ``-m cuda`` picks the tests in them."""
    marked = re.compile(r"^\s*@pytest\.mark\.cuda\b", re.MULTILINE)
    tests = REPO / "tests"
    return sorted(p for p in tests.rglob("test_*.py") if marked.search(p.read_text()))


def run_cuda_tests(timeout: float) -> dict[str, Any]:
    """``pytest -m cuda -n 0`` over ``cuda_test_files()`` in a child process: its counts
    and each test's outcome, from its JUnit XML report."""
    files = cuda_test_files()
    with tempfile.TemporaryDirectory(prefix="ckd-gpu-tests-") as folder:
        report = Path(folder) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-m", "cuda", "-n", "0", "-q"]
        command += ["-p", "no:cacheprovider", f"--junitxml={report}"]
        command += [str(f.relative_to(REPO)) for f in files]
        started = time.monotonic()
        try:
            done = subprocess.run(
                command,
                check=False,
                cwd=REPO,
                env=repo_env(),
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return {"files": [str(f.relative_to(REPO)) for f in files], "timed_out": True}
        results = _junit(report) if report.exists() else {}
    return {
        "files": [str(f.relative_to(REPO)) for f in files],
        "command": " ".join(command[1:]),
        "returncode": done.returncode,
        "seconds": time.monotonic() - started,
        "timed_out": False,
        "summary": (done.stdout.strip().splitlines() or [""])[-1],
        **results,
    }


def _junit(report: Path) -> dict[str, Any]:
    outcomes: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcome = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
        outcomes[name] = {"failure": "failed", "error": "error"}.get(outcome, outcome)
    counts = {k: sum(v == k for v in outcomes.values()) for k in ("passed", "failed", "skipped")}
    return {**counts, "errors": sum(v == "error" for v in outcomes.values()), "tests": outcomes}


def _median(series: dict[str, Any], name: str) -> float:
    found = series.get(name, {}).get("median")
    return math.nan if found is None else float(found)


def ratios(bench: dict[str, Any]) -> dict[str, float]:
    """Every goal's and reported ratio of medians (NaN where a series is missing)."""
    series = bench["series"]
    pairs = [(name, top, bottom) for name, _, top, bottom, _ in GOALS] + list(REPORTED)
    return {name: _median(series, top) / _median(series, bottom) for name, top, bottom in pairs}


def verdict(
    cuda: bool, tests: dict[str, Any], found: dict[str, float], error: str | None = None
) -> dict[str, Any]:
    """Each goal's status (``pass``, ``fail``, or ``skipped`` with why) and ``ok``; a
    benchmark that raised ``error`` fails every figure's goal, with or without CUDA."""
    goals: list[dict[str, Any]] = []
    for name, what, _, _, limit in GOALS:
        ratio = found[name]
        if error is not None:
            status = f"fail: the benchmark raised {error}"
        elif not cuda:
            status = NO_CUDA
        elif math.isnan(ratio):
            status = "fail: not measured within the budget"
        else:
            status = "pass" if ratio <= limit else "fail"
        goal = {"goal": name, "what": what, "at_most": limit, "ratio": _number(ratio)}
        goals.append({**goal, "status": status})
    goals.append(
        {"goal": "cuda_tests", "what": "every test marked cuda passes", **_tests(cuda, tests)}
    )
    return {
        "cuda": cuda,
        "goals": goals,
        "ok": not any(g["status"].startswith("fail") for g in goals),
    }


def _number(value: float) -> float | None:
    """``value``, or None for NaN (not measured): JSON has no NaN."""
    return None if math.isnan(value) else value


def _tests(cuda: bool, tests: dict[str, Any]) -> dict[str, str]:
    if tests.get("timed_out"):
        return {"status": "fail: the CUDA tests ran past their time"}
    if "passed" not in tests:
        return {"status": f"fail: pytest wrote no report (exit {tests.get('returncode')})"}
    counts = f"{tests['passed']} passed, {tests['failed']} failed, {tests['errors']} errors, "
    counts += f"{tests['skipped']} skipped"
    if tests["failed"] or tests["errors"] or tests["returncode"] not in (0, 5):
        return {"status": f"fail: {counts}", "counts": counts}
    if not cuda:
        return {"status": f"{NO_CUDA} ({counts})", "counts": counts}
    if tests["skipped"] or not tests["passed"]:
        return {"status": f"fail: not every CUDA test ran ({counts})", "counts": counts}
    return {"status": "pass", "counts": counts}


def report(results: dict[str, Any]) -> str:
    """The figures and the verdict, for humans."""
    bench = results["benchmark"]
    rows = [
        f"gpu_check on {bench['device']}: state {bench.get('state_bytes', 0) / GB:.3f} GB in "
        f"{bench.get('tensors', 0)} tensors, {bench.get('reps', 0)} reps after a warm-up, "
        f"files warm; load average {results['machine']['loadavg'][0]:.2f}",
    ]
    if not results["cuda"]:
        rows.append(
            "no CUDA device on this machine: the CUDA tests skip and the benchmark ran its "
            "CPU rehearsal at toy size; none of its figures is a goal's"
        )
    if "error" in bench:
        rows.append(f"the benchmark failed: {bench['error']}")
    rows.append("medians (warm-ups, series NAME.first.*, in the JSON):")
    for name, summary in bench["series"].items():
        parts = set(name.split("."))
        if summary["median"] is not None and not parts & {"first", "service_from_memory"}:
            rows.append(f"  {name:34}{summary['median'] * 1e3:10.2f} ms")
    rows.append("ratios of medians:")
    rows += [f"  {name:50}{_shown(value)}" for name, value in results["ratios"].items()]
    rows.append("verdict:")
    for goal in results["verdict"]["goals"]:
        limit = f" (<= {goal['at_most']}x: {_shown(goal['ratio'])})" if "at_most" in goal else ""
        rows.append(f"  {goal['what']}{limit}: {goal['status']}")
    rows.append(
        "  all goals met"
        if results["verdict"]["ok"] and results["cuda"]
        else "  a goal was missed"
        if not results["verdict"]["ok"]
        else "  nothing judged: no CUDA device"
    )
    return "\n".join(rows)


def _shown(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.3f}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check; 1 if a goal is missed or a test fails, else 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=4.0, help="state on the GPU (GB, with AdamW)")
    parser.add_argument("--reps", type=int, default=3, help="measured repetitions")
    parser.add_argument("--budget-s", type=float, default=480.0, help="the whole run's deadline")
    parser.add_argument("--started", type=float, default=None, help="epoch the budget began")
    parser.add_argument("--smoke", action="store_true", help="toy size, one repetition")
    parser.add_argument("--dir", type=Path, default=None, help="where the checkpoints go")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the JSON (default: benchmarks/results/gpu_check.json on CUDA, else in /tmp)",
    )
    args = parser.parse_args(argv)
    spent = 0.0 if args.started is None else max(0.0, time.time() - args.started)
    deadline = time.monotonic() + args.budget_s - spent
    cuda = torch.cuda.is_available()
    if not cuda:
        print(f"gpu_check: no CUDA device on this machine; every CUDA goal is {NO_CUDA}")
    # The tests get the budget but what the benchmark needs (a guess: 3 minutes at 4 GB).
    left = deadline - time.monotonic() - (30.0 if args.smoke else 180.0)
    tests = run_cuda_tests(timeout=max(30.0, min(300.0, left)))
    print(f"gpu_check: CUDA tests: {tests.get('summary', 'timed out')}")
    nbytes = gpu_figures.TOY_BYTES if args.smoke else int(args.gb * GB)
    try:
        bench = gpu_figures.measure(nbytes, 1 if args.smoke else args.reps, deadline - 10, args.dir)
    except Exception as exc:  # the tests' outcome and this still go into the JSON
        traceback.print_exc()
        bench = {"device": "cuda" if cuda else "cpu", "error": repr(exc), "series": {}}
    found = ratios(bench)
    results = {
        "cuda": cuda,
        "torch": torch.__version__,
        "machine": machine(args.dir or Path(tempfile.gettempdir())),
        "budget_s": args.budget_s,
        "tests": tests,
        "benchmark": bench,
        "ratios": {name: _number(value) for name, value in found.items()},
        "verdict": verdict(cuda, tests, found, bench.get("error")),
        "seconds": args.budget_s - (deadline - time.monotonic()),
    }
    if args.out is None:  # a CPU rehearsal's figures are not results to keep
        results_dir = REPO / "benchmarks/results" if cuda else Path(tempfile.gettempdir())
        args.out = results_dir / "gpu_check.json"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(report(results))
    print(f"gpu_check: figures in {args.out}")
    return 0 if results["verdict"]["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
