"""The trainer the containers tier runs inside the image (mounted, not installed).

``python job.py save ROOT SOCKET STEP OPTIONS_JSON`` saves a deterministic state through
the service at SOCKET, prints ``returned STEP`` (flushed) once ``save()`` returned, then
waits to be killed. ``python job.py restore ROOT SOCKET STEP OPTIONS_JSON`` restores into
zeroed tensors through the service and prints one JSON line: the step, the source, and
whether every tensor equals the saved one bit for bit.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

import checkpointd


def expected_state(step: int) -> dict[str, torch.Tensor]:
    """The state saved at ``step`` (a function of the step, so a restore can recompute it)."""
    generator = torch.Generator().manual_seed(step)
    return {
        "weights": torch.randn(512, 1024, generator=generator),
        "half": torch.randn(64, 64, generator=generator).to(torch.bfloat16),
        "step": torch.full((3,), step, dtype=torch.int64),
    }


class Holder:
    """A restore target holding tensors (a plain Stateful)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.tensors = {name: tensor.clone() for name, tensor in state.items()}


def save(root: str, socket: str, step: int, options: dict[str, Any]) -> None:
    writer = checkpointd.CheckpointWriter(root, storage_options=options, service=socket)
    writer.save(step, {"model": Holder(expected_state(step))})
    print(f"returned {step}", flush=True)
    while True:  # killed here, with the save in the service's hands
        time.sleep(60)


def restore(root: str, socket: str, step: int, options: dict[str, Any]) -> None:
    holder = Holder({name: torch.zeros_like(t) for name, t in expected_state(step).items()})
    info = checkpointd.restore(root, {"model": holder}, storage_options=options, service=socket)
    expected = expected_state(step)
    exact = holder.tensors.keys() == expected.keys() and all(
        holder.tensors[name].dtype == tensor.dtype and torch.equal(holder.tensors[name], tensor)
        for name, tensor in expected.items()
    )
    print(json.dumps({"step": info.step, "source": info.source, "bit_exact": exact}), flush=True)


if __name__ == "__main__":
    mode, root, socket, step, options = sys.argv[1:]
    {"save": save, "restore": restore}[mode](root, socket, int(step), json.loads(options))
