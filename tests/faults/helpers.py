"""State builders and checks shared by the fault tests."""

from __future__ import annotations

from typing import Any

import torch

import checkpointd


def make_state(step: int, size: int = 256) -> dict[str, Any]:
    """Three components (two with tensors, one plain): five files per save."""
    gen = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w": torch.randn(size, 4, generator=gen),
            "b": torch.full((size,), float(step)),
        },
        "opt": {"m": torch.randint(0, 1000, (size,), generator=gen), "lr": 0.1 * step},
        "meta": {"step": step, "tag": f"s{step}"},
    }


def same(a: Any, b: Any) -> bool:
    """Deep equality with bit-exact tensors."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def check_intact(root: str, expected: dict[int, dict[str, Any]], **kw: Any) -> list[int]:
    """Load every visible checkpoint with digests verified; each must equal what was saved.

    Returns the visible steps. Fails if any visible step is torn, unknown or different."""
    steps = [info.step for info in checkpointd.list_checkpoints(root, **kw)]
    for step in steps:
        assert step in expected, f"step {step} is visible but was never saved"
        loaded = checkpointd.load(root, step, verify=True, **kw)
        assert same(loaded.state, expected[step]), f"step {step} differs from what was saved"
    if steps:
        assert checkpointd.load(root, **kw).info.step == steps[-1]
    return steps
