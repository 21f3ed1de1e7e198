"""Start the ranks of a small torch.distributed job as subprocesses and collect reports."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_ranks(
    module: str,
    args: Sequence[str],
    out: Path,
    world: int,
    port: int,
    *,
    env: Mapping[str, str] | None = None,
) -> tuple[list[subprocess.Popen[bytes]], list[Any]]:
    """Start ``python -m module *args RANK WORLD PORT`` for every rank (stderr to
    OUT/stderrR.txt); return the processes and their open log files."""
    out.mkdir(parents=True, exist_ok=True)
    full_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
        **(env or {}),
    }
    logs = [(out / f"stderr{rank}.txt").open("wb") for rank in range(world)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, *args, str(rank), str(world), str(port)],
            env=full_env,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=logs[rank],
        )
        for rank in range(world)
    ]
    return procs, logs


def run_ranks(
    module: str,
    args: Sequence[str],
    out: Path,
    world: int,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 90,
) -> list[dict[str, Any] | None]:
    """Run ``python -m module *args RANK WORLD PORT`` for every rank (stderr to
    OUT/stderrR.txt); wait for all, kill stragglers after ``timeout`` seconds; return
    each rank's OUT/rankR.json (None where it wrote none)."""
    procs, logs = start_ranks(module, args, out, world, free_port(), env=env)
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    reports: list[dict[str, Any] | None] = []
    for rank in range(world):
        path = out / f"rank{rank}.json"
        reports.append(json.loads(path.read_text()) if path.exists() else None)
    return reports
