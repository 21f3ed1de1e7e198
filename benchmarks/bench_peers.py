"""Peer replicas of the memory tier: a lost node's ranks restore from a peer's memory
instead of storage, and what replicating costs the saves.

    python -m benchmarks.bench_peers [--smoke] [--mb MB] [--reps N] [--dir DIR]

4 nodes on this machine: 4 ``checkpointd serve`` (``--peer-address 127.0.0.1``, real
TCP between them), one gloo rank each, an FSDP2 MLP with AdamW (``--mb`` of parameters:
3x that in all; 96 MB -> about 290 MB). Per storage (local disk, S3 through moto):

- a save job writes each repetition to a root with ``replicas=0`` and one with
  ``replicas=1``, alternating: ``save()`` blocked, time until durable and the training
  step time while the save is in flight (the slowest rank's), side by side; and the
  bytes the services sent per replicated save against k x the held shares;
- then node 3 is lost (its service SIGKILLed, a new empty one in its place) and a new
  job of 4 ranks restores each root with ``service=``: the lost node's rank reads its
  share from a peer (replicas=1) or from storage (replicas=0; a cold page cache for
  local disk), the other ranks from their own memory; bit for bit against the saved
  shards. A new empty node-3 service for each repetition.

Prints medians [min..max] and the ratios against the goals (issue 34).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    Series,
    Table,
    fmt_seconds,
    pick_folder,
    repo_env,
    spawn,
    start_service,
)

WORLD = 4
PEERS = ("--peer-address", "127.0.0.1")
REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _job(action: str, args: list[str], env: dict[str, str]) -> None:
    port = str(_free_port())
    procs = [
        spawn(
            [
                *(sys.executable, "-m", "benchmarks.peers_rank_worker", action),
                *(*args, str(rank), str(WORLD), port),
            ],
            env=env,
            cwd=REPO,
            stdin=subprocess.DEVNULL,
        )
        for rank in range(WORLD)
    ]
    codes = [proc.wait(3600) for proc in procs]
    if any(codes):
        raise RuntimeError(f"a {action} rank failed: exit codes {codes}")


def _status(socket: str) -> Any:
    from checkpointd.daemon.client.client import status

    return status(socket)


def _settled(sockets: list[str], saves: int) -> list[Any]:
    """Wait until every service is idle and has sent or superseded ``saves`` replicas."""
    deadline = time.monotonic() + 600
    while True:
        replies = [_status(s) for s in sockets]
        if all(
            not r.saves_in_flight
            and not r.replicas_pending
            and r.replicas_sent + r.replicas_superseded >= saves
            for r in replies
        ):
            return replies
        if time.monotonic() > deadline:
            raise RuntimeError(f"replicas not sent: {replies}")
        time.sleep(0.1)


def run_storage(
    label: str, roots: tuple[str, str], folder: Path, *, mb: float, reps: int, env: dict[str, str]
) -> dict[str, Any]:
    """One storage's rows (see the module docstring)."""
    homes = [tempfile.mkdtemp(prefix="ckd-peers-", dir="/tmp") for _ in range(WORLD)]
    spare: list[str] = []
    services = [start_service(home, *PEERS, env=env) for home in homes]
    sockets = [os.path.join(home, "sock") for home in homes]
    out = folder / f"out-{label}"
    out.mkdir(parents=True)
    try:
        args = [*roots, ",".join(sockets), str(mb), str(reps), str(out)]
        _job("save", args, env)
        replies = _settled(sockets, reps + 1 + 1)  # warm-up, reps, the final save
        saves = [json.loads((out / f"save{r}.json").read_text()) for r in range(WORLD)]
        table = Table()
        for name in ("replicas0", "replicas1"):
            for i, what in enumerate(("blocked", "durable", "step")):
                for per_rank in zip(*(s[name] for s in saves), strict=True):
                    table.add(f"{name}.{what}", max(row[i] for row in per_rank))
        table.add("idle.step", max(s["idle_step"] for s in saves))
        superseded = sum(r.replicas_superseded for r in replies)
        sent = sum(r.replica_bytes_sent for r in replies) / (reps + 2)
        shares = sum(r.bytes_kept for r in replies) / 2  # each node keeps one step per root
        restores: list[dict[str, Any]] = []
        for _ in range(reps):
            services[-1].send_signal(signal.SIGKILL)  # node 3 is lost
            services[-1].wait()
            home = tempfile.mkdtemp(prefix="ckd-peers-", dir="/tmp")
            spare.append(home)
            services[-1] = start_service(home, *PEERS, env=env)
            sockets[-1] = os.path.join(home, "sock")
            args = [*roots, ",".join(sockets), str(mb), str(reps), str(out)]
            _job("restore", args, env)
            restores.append(
                {
                    "ranks": [
                        json.loads((out / f"restore{r}.json").read_text()) for r in range(WORLD)
                    ]
                }
            )
        for kind in ("peer", "storage"):
            for rep in restores:
                ranks = rep["ranks"]
                table.add(f"restore.{kind}.lost", ranks[-1][kind]["seconds"])
                table.add(f"restore.{kind}.intact", max(r[kind]["seconds"] for r in ranks[:-1]))
        sources = {k: [r[k]["source"] for r in restores[-1]["ranks"]] for k in ("peer", "storage")}
        exact = all(
            r[k]["exact"] for rep in restores for r in rep["ranks"] for k in ("peer", "storage")
        )
        return {
            "series": table.as_json(),
            "bytes_sent_per_save": sent,
            "superseded": superseded,
            "shares": shares,
            "sources": sources,
            "exact": exact,
        }
    finally:
        for proc in services:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(60)
        for home in homes + spare:
            shutil.rmtree(home, ignore_errors=True)


def report(label: str, result: dict[str, Any]) -> list[str]:
    """The lines of one storage's rows and ratios."""
    s = {name: Series(list(v["values"])) for name, v in result["series"].items()}
    med = {name: series.median for name, series in s.items()}
    lines = [f"[peers] {label}"]
    for name, series in s.items():
        lines.append(f"  {name:<24} {fmt_seconds(series)}")
    ratio = med["restore.peer.lost"] / med["restore.storage.lost"]
    lines.append(f"  lost node's restore, peer / storage: {ratio:.2f} (goal <= 0.33)")
    for what in ("blocked", "durable"):
        r = med[f"replicas1.{what}"] / med[f"replicas0.{what}"]
        lines.append(f"  save {what}, replicas=1 / replicas=0: {r:.2f} (goal <= 1.05)")
    r = med["replicas1.step"] / med["replicas0.step"]
    idle = med["idle.step"]
    lines.append(f"  step time during a save, replicas=1 / replicas=0: {r:.2f} (idle {idle:.3f} s)")
    sent, shares = result["bytes_sent_per_save"], result["shares"]
    lines.append(
        f"  bytes sent per save {sent / 2**20:.1f} MiB; k x shares {shares / 2**20:.1f} MiB ({sent / shares:.2f})"
    )
    lines.append(f"  replicas superseded by a newer step before they went: {result['superseded']}")
    lines.append(f"  sources {result['sources']}; bit-exact: {result['exact']}")
    return lines


def run(folder: Path, mb: float, reps: int, s3: bool = True) -> dict[str, Any]:
    """Both storages' rows."""
    env = repo_env()
    results: dict[str, Any] = {}
    local = folder / "local"
    results["local disk (cold cache)"] = run_storage(
        "local", (str(local / "r0"), str(local / "r1")), folder, mb=mb, reps=reps, env=env
    )
    if s3:
        import logging

        from tests.support.s3 import start_moto

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's access log
        moto = start_moto()
        try:
            moto.create_bucket("peers")
            s3env = {**env, "CHECKPOINTD_BENCH_OPTIONS": json.dumps(moto.storage_options())}
            results["s3 (moto)"] = run_storage(
                "s3", ("s3://peers/r0", "s3://peers/r1"), folder, mb=mb, reps=reps, env=s3env
            )
        finally:
            moto.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny state, one repetition")
    parser.add_argument("--mb", type=float, default=96.0, help="parameters in MB (3x in all)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-s3", action="store_true", help="local disk only")
    parser.add_argument("--dir", help="folder to write in (default $CHECKPOINTD_BENCH_DIR or /tmp)")
    args = parser.parse_args(argv)
    mb, reps = (2.0, 1) if args.smoke else (args.mb, args.reps)
    base = pick_folder(args.dir, int(mb * 3 * 2**20 * 4))
    folder = Path(tempfile.mkdtemp(prefix="bench-peers-", dir=base))
    try:
        results = run(folder, mb, reps, s3=not args.no_s3)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    for label, result in results.items():
        print("\n".join(report(label, result)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
