"""A fresh process's first ``load`` imports what a load runs, not the restore path.

A resume that loads a checkpoint in a new process pays for every module the call
imports (~30 ms of CPU for the restore path's: read/apply, inplace, boxes, landing,
ranks/group, state/fit...; issue 35 item 1). Each test runs in a fresh interpreter.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

import checkpointd

RESTORE_ONLY = (
    "checkpointd.read.apply",
    "checkpointd.read.inplace",
    "checkpointd.read.boxes",
    "checkpointd.read.landing",
    "checkpointd.read.bounce",
    "checkpointd.read.todevice",
    "checkpointd.ranks.group",
    "checkpointd.state.fit",
    "checkpointd.state.loading",
)


def _saved(root: Path) -> dict[str, torch.Tensor]:
    state = {"w": torch.arange(48, dtype=torch.float32).reshape(6, 8), "b": torch.ones(3)}
    with checkpointd.CheckpointWriter(root) as writer:
        writer.save(1, {"model": state}).result()
    return state


def _child(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_first_load_imports_none_of_the_restore_path(tmp_path: Path) -> None:
    _saved(tmp_path)
    out = _child(
        "import sys, torch, checkpointd\n"
        f"loaded = checkpointd.load({str(tmp_path)!r})\n"
        "w = loaded.state['model']['w']\n"
        "assert torch.equal(w, torch.arange(48, dtype=torch.float32).reshape(6, 8))\n"
        f"print(sorted(set({RESTORE_ONLY!r}) & set(sys.modules)))\n"
    )
    assert out.strip() == "[]", out


def test_restore_and_a_load_onto_a_device_import_what_they_need(tmp_path: Path) -> None:
    # The same process loads first (nothing of the restore path imported), then restores
    # into live tensors and loads with map_location: both import what they run.
    saved = _saved(tmp_path)
    out = _child(
        "import torch, checkpointd\n"
        f"root = {str(tmp_path)!r}\n"
        "checkpointd.load(root)\n"
        "live = {'w': torch.zeros(6, 8), 'b': torch.zeros(3)}\n"
        "info = checkpointd.restore(root, {'model': live})\n"
        "onto = checkpointd.load(root, map_location='cpu').state['model']\n"
        "print(info.restored, live['w'].sum().item(), live['b'].sum().item(),"
        " onto['w'].sum().item(), onto['w'].device)\n"
    )
    total = saved["w"].sum().item()
    assert out.split() == ["('model',)", str(total), "3.0", str(total), "cpu"], out
