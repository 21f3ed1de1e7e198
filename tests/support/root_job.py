"""A trainer that saves or restores one model through a service with the root it is
given as is (relative roots included), in the working folder it was started in.

``python -m tests.support.root_job SERVICE ROOT save SEED STEP``: save ``model(SEED)``
at STEP; ``... restore SEED``: restore into a fresh model and compare it with
``model(SEED)``. Either way one JSON line: what was listed under ROOT from here, and
for a restore its step, source and whether the model is this job's own.
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn


def model(seed: int) -> nn.Module:
    """The model a job of ``seed`` saves (deterministic)."""
    torch.manual_seed(seed)
    return nn.Linear(64, 64)


def main(service: str, root: str, action: str, seed: int, step: int | None) -> None:
    import checkpointd

    result: dict[str, object] = {}
    if action == "save":
        assert step is not None
        with checkpointd.CheckpointWriter(root, service=service) as writer:
            writer.save(step, {"model": model(seed)}).result(60)
    else:
        target = model(10_000 + seed)
        info = checkpointd.restore(root, {"model": target}, service=service)
        own = model(seed).state_dict()
        result["step"] = info.step
        result["source"] = info.source
        result["own"] = all(torch.equal(v, own[k]) for k, v in target.state_dict().items())
    result["listed"] = [c.step for c in checkpointd.list_checkpoints(root)]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    service, root, action, seed = sys.argv[1:5]
    main(service, root, action, int(seed), int(sys.argv[5]) if len(sys.argv) > 5 else None)
