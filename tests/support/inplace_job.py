"""One rank of an FSDP2 job restoring straight into its local shards, run as a subprocess.

    python -m tests.support.inplace_job ACTION ROOT OUT RANK WORLD PORT

``save``: shard_job's MLP under FSDP2 and AdamW, trained two steps, saved as step 1
with a ``picky`` component (count 2); rank 0 writes OUT/save.pt (the gathered state).
The other actions build the model from another seed and train it one step (so the
optimizer has state), then restore with targets ``model``, ``optimizer`` and
``picky``: ``restore`` (Picky(2), must succeed), ``refused`` (Picky(9) refuses a count
of 2 after the model and optimizer were loaded), ``damaged`` (the test damaged a
shard file first) or ``scribble`` (a byte of the model's shard file flipped after its
check pass: the landing must notice). Rank 0 writes OUT/{ACTION}.pt, the gathered state after it. Every
rank writes OUT/rankR.json: ``ok``, ``error``, ``message``, ``landed`` (direct DTensors
read into their local shards), ``same_memory`` (every local shard of the model and the
optimizer is the tensor it was before), ``unchanged`` (those local shards hold what they held before),
``bounced`` (bytes copied out of the bounce buffer's staging: with CHECKPOINTD_TEST_BOUNCE
set to a block size, CPU local shards land through read/bounce.py as CUDA ones do).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

import checkpointd
from checkpointd import tunables
from checkpointd.read import bounce, boxes
from tests.support.shard_job import build, full_state, train


class Picky:
    """Refuses a count of 2 unless made with 2."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.accepts_two = count == 2

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["count"] == 2 and not self.accepts_two:
            raise ValueError("injected: refused")
        self.count = state["count"]


def _locals(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    found = [p.to_local() for p in model.parameters()]  # type: ignore[operator]
    for state in optimizer.state.values():
        found += [v.to_local() for v in state.values() if hasattr(v, "to_local")]
    return found


def _scribble_after_check(root: str) -> None:
    """Make the model's check pass flip the last byte of its last piece's file."""
    checked = boxes.Boxes.check

    def then_scribble(self: boxes.Boxes) -> None:
        checked(self)
        # After the model's check pass: flip the last byte of its last piece's file.
        if any(name.endswith("weight") for name in self.boxes):
            piece = list(self.boxes.values())[-1].parts[-1]
            path = os.path.join(root, f"{1:012d}", piece.shard.file)
            at = piece.shard.begin + piece.total - 1
            os.chmod(path, 0o644)
            with open(path, "r+b") as f:
                f.seek(at)
                byte = f.read(1)[0]
                f.seek(at)
                f.write(bytes([byte ^ 0xFF]))

    boxes.Boxes.check = then_scribble  # type: ignore[method-assign]


def main() -> None:
    action, root, out, rank_s, world_s, port = sys.argv[1:]
    rank, world = int(rank_s), int(world_s)
    tunables.SHARD_BLOCK_BYTES = int(os.environ.get("CHECKPOINTD_TEST_BLOCK", "256"))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    result: dict[str, Any] = {"ok": False, "error": None, "message": "", "landed": 0}
    result["bounced"] = 0
    original = boxes.Boxes.land

    def counted(self: boxes.Boxes, *args: Any) -> None:
        result["landed"] += len(self.boxes)
        original(self, *args)

    boxes.Boxes.land = counted  # type: ignore[method-assign]
    if os.environ.get("CHECKPOINTD_TEST_BOUNCE"):  # CPU local shards through bounce.py
        tunables.BOUNCE_CPU_TARGETS = True
        tunables.BOUNCE_BYTES = 2 * int(os.environ["CHECKPOINTD_TEST_BOUNCE"])
        copy = bounce.HostTransfer.copy

        def copied(self: bounce.HostTransfer, dst: torch.Tensor, src: torch.Tensor) -> None:
            result["bounced"] += src.numel()
            copy(self, dst, src)

        bounce.HostTransfer.copy = copied  # type: ignore[method-assign]
    if action == "scribble":
        _scribble_after_check(root)
    if action == "save":
        model, optimizer = build("fsdp2", world, seed=0)
        train(model, optimizer, 2)
        with checkpointd.CheckpointWriter(root) as writer:
            writer.save(1, {"model": model, "optimizer": optimizer, "picky": Picky(2)}).result()
        state = full_state(model, optimizer)
        result["ok"] = True
    else:
        model, optimizer = build("fsdp2", world, seed=1)
        train(model, optimizer, 1)
        before = [t.clone() for t in _locals(model, optimizer)]
        memory = [t.data_ptr() for t in _locals(model, optimizer)]
        targets = {
            "model": model,
            "optimizer": optimizer,
            "picky": Picky(9 if action == "refused" else 2),
        }
        try:
            checkpointd.restore(root, targets)
            result["ok"] = True
        except checkpointd.CheckpointError as exc:
            result["error"] = type(exc).__name__
            result["message"] = str(exc)
        now = _locals(model, optimizer)
        result["same_memory"] = memory == [t.data_ptr() for t in now]
        result["unchanged"] = len(now) == len(before) and all(map(torch.equal, before, now))
        state = full_state(model, optimizer)
        train(model, optimizer, 1)  # the optimizer must still train after either outcome
    if rank == 0:
        torch.save(state, os.path.join(out, f"{action}.pt"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
