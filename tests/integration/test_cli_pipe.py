"""The command line when its reader goes away: ``checkpointd ls ROOT | head -1``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

import checkpointd


def test_ls_into_a_closed_pipe_stops_quietly(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with checkpointd.CheckpointWriter(str(root)) as writer:
        for step in range(1, 4):
            writer.save(step, {"w": torch.zeros(2)}, metadata={"pad": "x" * 100_000})
    # --json prints one long line: far more than a pipe buffer, so writing it hits EPIPE.
    with subprocess.Popen(
        [sys.executable, "-m", "checkpointd", "ls", str(root), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as ls:
        assert ls.stdout is not None
        assert ls.stderr is not None
        first = ls.stdout.read(1)  # like `head -c1`: read a little, then close our end
        ls.stdout.close()
        stderr = ls.stderr.read().decode()
        status = ls.wait(timeout=60)
    assert first == b"["
    assert stderr == ""
    assert status == 141
