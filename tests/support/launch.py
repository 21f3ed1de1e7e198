"""Start the ranks of a small torch.distributed job as subprocesses and collect reports."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.support import zygote

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tcp_store(port: int, *, host: bool) -> Any:
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=host,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )


@contextmanager
def hosted_store() -> Iterator[int]:
    """A job's TCP store hosted by the test, so that it outlives the ranks (as torchrun's
    agent hosts it); its port."""
    port = free_port()
    store = _tcp_store(port, host=True)
    yield port
    del store


def join_hosted_store(port: int, rank: int, world: int) -> None:
    """A rank's side of ``hosted_store``: connect to it and start the gloo group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=_tcp_store(port, host=False), rank=rank, world_size=world)


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
    OUT/stderrR.txt), each forked by the session's zygote (``zygote.popen``); return the
    processes and their open log files."""
    out.mkdir(parents=True, exist_ok=True)
    full_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
        **(env or {}),
    }
    logs = [(out / f"stderr{rank}.txt").open("wb") for rank in range(world)]
    procs = [
        zygote.popen(
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
    each rank's OUT/rankR.json (None where it wrote none). The ranks are forked by the
    session's zygote (tests/support/zygote.py), which has paid the imports once; with
    CHECKPOINTD_TEST_ZYGOTE=0 each is a fresh interpreter instead."""
    if zygote.enabled():
        _run_forked(module, args, out, world, env=env, timeout=timeout)
        return _reports(out, world)
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
    return _reports(out, world)


def _run_forked(
    module: str,
    args: Sequence[str],
    out: Path,
    world: int,
    *,
    env: Mapping[str, str] | None,
    timeout: float,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    full_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
        **(env or {}),
    }
    forks = zygote.shared()
    running: list[int] = []
    try:
        for rank in range(world):
            rank_args = [*args, str(rank), str(world), str(port)]
            running.append(forks.start(module, rank_args, full_env, out / f"stderr{rank}.txt"))
        deadline = time.monotonic() + timeout
        while running:
            if forks.wait(running[0], max(0.0, deadline - time.monotonic())) is None:
                raise subprocess.TimeoutExpired([module, *args], timeout)
            running.pop(0)
    finally:
        for pid in running:
            forks.kill(pid)


def _reports(out: Path, world: int) -> list[dict[str, Any] | None]:
    reports: list[dict[str, Any] | None] = []
    for rank in range(world):
        path = out / f"rank{rank}.json"
        reports.append(json.loads(path.read_text()) if path.exists() else None)
    return reports
