"""A trainer whose state grows between saves, through a service (``--memory-limit`` tests).

``python -m tests.support.growing_job SOCKET ROOT FIRST STORAGE_OPTIONS_JSON`` saves
step FIRST with a 40 MiB state, then step FIRST+1 with a 120 MiB one (``max_pending=2``,
so the second save's memory is asked for while the first may still be in flight),
printing ``returned N`` after each save() and ``saving N`` just before the second, then
``committed`` once both committed.
"""

from __future__ import annotations

import json
import sys

import torch

MIB = 1024 * 1024


def state(step: int, mib: int) -> dict[str, torch.Tensor]:
    """``mib`` MiB of float32 that depend on ``step``."""
    return {"weights": torch.full((mib * MIB // 4,), float(step)), "step": torch.tensor(step)}


def main(socket: str, root: str, first: int, options: dict[str, object] | None) -> None:
    import checkpointd

    with checkpointd.CheckpointWriter(
        root, service=socket, max_pending=2, storage_options=options
    ) as writer:
        writer.save(first, {"model": state(first, 40)})
        print(f"returned {first}", flush=True)
        print(f"saving {first + 1}", flush=True)
        writer.save(first + 1, {"model": state(first + 1, 120)})
        print(f"returned {first + 1}", flush=True)
        writer.wait(120)
    print("committed", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]))
