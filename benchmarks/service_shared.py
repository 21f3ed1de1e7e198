"""Two trainers sharing one checkpoint service and saving at the same moments, as the
local ranks of a node do: each save's ``save()`` blocked time, per trainer.

    python -m benchmarks.service_shared [--src SRC] [--saves 8] [--mb 200]

``--src`` runs another checkpointd source folder (a worktree of an older commit) for a
before/after comparison. The first two saves of each trainer make their segments; the
later ones should all reuse one (a fresh segment costs its page faults in save()).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, repo_env, start_service


def _wait_for(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.002)


def trainer(socket: str, root: str, folder: str, saves: int, mb: int) -> None:
    """One trainer: save when ``go.STEP`` appears, say ``done.STEP`` once committed."""
    import torch

    import checkpointd

    state = {"w": torch.randn(mb * 2**18)}
    blocked: list[float] = []
    with checkpointd.CheckpointWriter(root, keep_last=1, service=socket) as writer:
        for step in range(saves):
            _wait_for(os.path.join(folder, f"go.{step}"))
            handle = writer.save(step, {"m": state})
            handle.result()
            blocked.append(handle.blocked_seconds)
            Path(folder, f"done.{step}").touch()
    print(" ".join(f"{x:.3f}" for x in blocked))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", default=str(REPO / "src"))
    parser.add_argument("--saves", type=int, default=8)
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--trainer", nargs=3, help=argparse.SUPPRESS)  # socket root folder
    args = parser.parse_args()
    if args.trainer:
        trainer(*args.trainer, args.saves, args.mb)
        return
    env = repo_env(args.src)
    work = tempfile.mkdtemp(prefix="ckd-shared-", dir="/tmp")
    socket = os.path.join(work, "sock")
    service = start_service(work, env=env)
    try:
        folders = [os.path.join(work, f"t{i}") for i in range(2)]
        trainers = []
        for folder in folders:
            os.makedirs(folder)
            command = [sys.executable, "-m", "benchmarks.service_shared", "--saves"]
            command += [str(args.saves), "--mb", str(args.mb), "--trainer", socket]
            command += [os.path.join(folder, "root"), folder]
            trainers.append(
                subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True, cwd=REPO)
            )
        for step in range(args.saves):
            for folder in folders:  # both at once
                Path(folder, f"go.{step}").touch()
            for folder in folders:
                _wait_for(os.path.join(folder, f"done.{step}"))
        outputs = [t.communicate()[0].split() for t in trainers]
    finally:
        service.terminate()
        service.wait()
        shutil.rmtree(work, ignore_errors=True)
    later = [float(x) for out in outputs for x in out[2:]]
    print(f"{args.src}: save() blocked, {args.mb} MB, trainer 0 | trainer 1:")
    print(f"  {' '.join(outputs[0])} | {' '.join(outputs[1])}")
    print(
        f"  saves 3 to {args.saves}: median {statistics.median(later):.3f} s, max {max(later):.3f} s"
    )


if __name__ == "__main__":
    main()
