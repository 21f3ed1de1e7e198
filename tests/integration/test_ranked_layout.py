"""What a many-rank writer keeps between saves of the same layout (the optimizer's
parameter names, shard layouts, the staging arena's views) never outlives the layout:
2 real gloo ranks (tests/support/layout_job.py) save an FSDP2 model and AdamW with one
writer while the layout changes under it (parameters renamed, a parameter group added,
a dtype and a placement changed), and every checkpoint loads as exactly what DCP
gathers of the live state at its save.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import checkpointd
from tests.support.launch import run_ranks


def same(stored: Any, live: Any, path: str = "") -> None:
    """Assert a loaded tree equals DCP's gathered one: keys in order, tensors bit for bit
    (dtype too), other values equal; a stored tuple may come back as a list."""
    if isinstance(live, dict):
        assert list(stored) == list(live), path
        for key in live:
            same(stored[key], live[key], f"{path}/{key}")
    elif isinstance(live, list | tuple):
        assert len(stored) == len(live), path
        for i, (a, b) in enumerate(zip(stored, live, strict=True)):
            same(a, b, f"{path}/{i}")
    elif isinstance(live, torch.Tensor):
        assert isinstance(stored, torch.Tensor), path
        assert stored.dtype == live.dtype, path
        assert torch.equal(stored, live), path
    else:
        assert stored == live, path


def test_a_changed_layout_after_cached_saves_writes_correct_checkpoints(tmp_path: Path) -> None:
    root, out = tmp_path / "root", tmp_path / "out"
    reports = run_ranks("tests.support.layout_job", [str(root), str(out)], out, 2, timeout=180)
    for rank, report in enumerate(reports):
        assert report is not None, (out / f"stderr{rank}.txt").read_text()[-3000:]
        assert report["ok"], report["error"]
    for step in range(1, 6):
        live = torch.load(out / f"expected{step}.pt", weights_only=True)
        stored = checkpointd.load(root, step).state
        same(stored["model"], live["model"], f"step {step}: model")
        same(stored["optimizer"], live["optimizer"], f"step {step}: optimizer")
        same(stored["t"], live["t"], f"step {step}: t")
    # the layout did change: the names moved, a group came, a dtype changed
    first = torch.load(out / "expected1.pt", weights_only=True)["optimizer"]
    last = torch.load(out / "expected5.pt", weights_only=True)["optimizer"]
    assert len(first["param_groups"]) == 1
    assert len(last["param_groups"]) == 2
    assert list(first["state"])[:2] == ["0.weight", "0.bias"]
    assert list(torch.load(out / "expected3.pt", weights_only=True)["optimizer"]["state"])[:2] == [
        "1.weight",
        "1.bias",
    ]
    assert last["state"]["2.weight"]["exp_avg"].dtype == torch.float64
