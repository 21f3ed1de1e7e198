"""benchmarks/gpu_check.sh runs end to end in its smoke mode: on a machine without CUDA
(CI) the CUDA tests report skipped, every CUDA goal reads so, and the benchmark's code
runs on CPU at toy size (not a timed test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.common import REPO

# Every file with a test marked cuda: gpu_check runs them all (on CPU, all skip).
CUDA_FILES = {f"tests/unit/test_{name}.py" for name in ("bounce", "capture", "rng", "staging")}
CUDA_FILES.add("tests/integration/test_service.py")  # the service's pinned segments
SERIES = [f"d2h.{f}" for f in ("pinned", "single")]
SERIES += [
    f"{c}.{f}"
    for c in ("blocking", "overlapped", "service", "dcp")
    for f in ("blocked", "staged", "durable")
]
SERIES += [f"restore.{c}" for c in ("checkpointd", "torch", "service")]


@pytest.mark.timeout(120)
def test_gpu_check_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    command = [str(REPO / "benchmarks/gpu_check.sh"), "--smoke", "--out", str(out)]
    command += ["--dir", str(tmp_path), "--budget-s", "100"]
    done = subprocess.run(
        command,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "installing" not in done.stdout  # this interpreter has all it needs
    results = json.loads(out.read_text())
    cuda = torch.cuda.is_available()
    assert results["cuda"] is cuda

    tests = results["tests"]
    assert set(tests["files"]) >= CUDA_FILES
    assert len(tests["tests"]) >= 9
    assert tests["failed"] == tests["errors"] == 0
    bench = results["benchmark"]
    assert bench["reps"] == 1
    assert bench["state_bytes"] >= 24 * 2**20
    for name in SERIES:
        assert bench["series"][name]["median"] > 0, name
    assert bench["series"]["restore.service_from_memory"]["median"] == 1.0  # the memory tier
    goals = {g["goal"]: g for g in results["verdict"]["goals"]}
    assert list(goals) == ["save_blocked", "overlapped_blocked", "restore_cuda", "cuda_tests"]
    assert all(g["ratio"] > 0 for g in list(goals.values())[:3])
    if cuda:
        return  # on a device the verdict is the check's own outcome
    assert set(tests["tests"].values()) == {"skipped"}
    assert tests["passed"] == 0
    assert tests["skipped"] == len(tests["tests"])
    for goal in goals.values():
        assert goal["status"].startswith("skipped: no CUDA device"), goal
    assert results["verdict"]["ok"] is True
    assert bench["device"] == "cpu"
    assert "no CUDA device" in done.stdout
    assert "nothing judged: no CUDA device" in done.stdout
    assert not list(tmp_path.glob("checkpointd-bench-*")), "work folders must be removed"


def test_on_a_device_a_missed_goal_or_a_skipped_cuda_test_fails_the_verdict() -> None:
    """What a GPU run judges, from figures as the benchmark writes them."""
    from benchmarks import gpu_check

    def bench(blocked: float) -> dict[str, Any]:
        medians = {"blocking.blocked": blocked, "d2h.pinned": 1.0, "overlapped.blocked": 0.05}
        medians |= {"restore.checkpointd": 0.7, "restore.torch": 1.0}
        return {"series": {k: {"median": v} for k, v in medians.items()}}

    ran = {"returncode": 0, "passed": 9, "failed": 0, "errors": 0, "skipped": 0}
    met = gpu_check.verdict(True, ran, gpu_check.ratios(bench(1.1)))
    assert [g["status"] for g in met["goals"]] == ["pass"] * 4
    assert met["ok"] is True
    missed = gpu_check.verdict(True, ran, gpu_check.ratios(bench(1.3)))
    assert [g["status"] for g in missed["goals"]] == ["fail", "pass", "pass", "pass"]
    assert missed["ok"] is False
    skipped = gpu_check.verdict(True, {**ran, "skipped": 1}, gpu_check.ratios(bench(1.1)))
    assert skipped["goals"][3]["status"].startswith("fail: not every CUDA test ran")
    unmeasured = gpu_check.verdict(True, ran, gpu_check.ratios({"series": {}}))
    assert unmeasured["goals"][0]["status"] == "fail: not measured within the budget"
    on_cpu = gpu_check.verdict(False, {**ran, "skipped": 9}, gpu_check.ratios(bench(1.3)))
    assert {g["status"].split(" (")[0] for g in on_cpu["goals"]} == {"skipped: no CUDA device"}
    assert on_cpu["ok"] is True
    failed_on_cpu = gpu_check.verdict(False, {**ran, "failed": 1}, gpu_check.ratios(bench(1.1)))
    assert failed_on_cpu["goals"][3]["status"].startswith("fail: ")
    assert failed_on_cpu["ok"] is False
