"""One rank of an incremental FSDP2 fine-tuning job (a frozen base, LoRA-like adapters),
run as a subprocess by tests/integration/test_incremental_ranks.py.

    python -m tests.support.lora_job ACTION ROOT OUT RANK WORLD PORT

ACTION ``save``: build the model (seed 0), shard it with FSDP2 over the WORLD gloo
ranks, and save steps 1..SAVES (environment CHECKPOINTD_TEST_SAVES, default 3) with an
``incremental=True, keep_last=2`` writer, one training step of the adapters between
saves. Rank 0 writes OUT/states.pt: per step the whole model and optimizer state by
parameter name (gathered by torch.distributed.checkpoint.state_dict) as saved; every
rank writes OUT/rank{RANK}.json with ``ok``, ``error`` and, per save, the
CheckpointInfo's ``nbytes``/``written``/``referenced`` and the manifest's ``blobs``. ACTION ``restore``: build the
model from another seed, restore step CHECKPOINTD_TEST_STEP (default the newest) into it
and write OUT/restored.pt (rank 0) the same way. ACTION ``pin-fails``: save step 1
while rank 1 cannot write its pin (``pin_fails``).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import checkpointd
from checkpointd import tunables
from checkpointd.read import catalog
from checkpointd.storage import open_store

DIM, RANK_R, LAYERS = 256, 64, 2
"""Base weights of 256x256 float32 (128 KiB a rank on 2 ranks), rank-64 adapters (32 KiB a
rank); with blobs from 16 KiB, every shard of both is a blob."""
MIN_BLOB_BYTES = 16 * 2**10


class LoraLinear(torch.nn.Module):
    """A frozen linear layer plus a trainable low-rank update ``b @ a``."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(DIM, DIM, bias=False)
        self.base.weight.requires_grad_(False)
        self.a = torch.nn.Parameter(torch.randn(RANK_R, DIM) / DIM)
        self.b = torch.nn.Parameter(torch.randn(DIM, RANK_R) / DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.T) @ self.b.T


def build(world: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*(LoraLinear() for _ in range(LAYERS)))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=0.01)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    batch = torch.randn(8, DIM, generator=torch.Generator().manual_seed(seed))
    model(batch).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Whole tensors by parameter name (a collective); copies, not the live tensors."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    return copy.deepcopy({"model": model_state, "optimizer": optim_state["state"]})


def main() -> None:
    action, root, out, rank_s, world_s, port = sys.argv[1:]
    rank, world = int(rank_s), int(world_s)
    tunables.INCREMENTAL_MIN_BYTES = MIN_BLOB_BYTES
    if os.environ.get("CHECKPOINTD_TEST_SHARD_INDEX") == "1":  # shard entries in indexes
        tunables.SHARD_INDEX_MIN_ENTRIES = 0
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    result: dict[str, Any] = {"ok": False, "error": None, "message": "", "saves": {}}
    try:
        if action == "save":
            model, optimizer = build(world, seed=0)
            states: dict[int, Any] = {}
            saves = int(os.environ.get("CHECKPOINTD_TEST_SAVES", "3"))
            with checkpointd.CheckpointWriter(root, incremental=True, keep_last=2) as writer:
                for step in range(1, saves + 1):
                    train_step(model, optimizer, seed=step)
                    states[step] = full_state(model, optimizer)
                    info = writer.save(step, {"model": model, "optimizer": optimizer}).result()
                    manifest = catalog.read_manifest(open_store(root), step)
                    result["saves"][step] = {
                        "nbytes": info.nbytes,
                        "written": info.written_nbytes,
                        "referenced": info.referenced_nbytes,
                        "blobs": sorted(b.name for b in manifest.blobs),
                    }
            if rank == 0:
                torch.save(states, os.path.join(out, "states.pt"))
        elif action == "pin-fails":
            pin_fails(root, world, rank, result)
        else:
            model, optimizer = build(world, seed=1)
            train_step(model, optimizer, seed=0)  # so the optimizer has state to restore into
            step = os.environ.get("CHECKPOINTD_TEST_STEP")
            checkpointd.restore(
                root,
                {"model": model, "optimizer": optimizer},
                step=None if step is None else int(step),
            )
            restored = full_state(model, optimizer)
            if rank == 0:
                torch.save(restored, os.path.join(out, "restored.pt"))
        result["ok"] = True
    except checkpointd.CheckpointError as exc:
        result["error"] = type(exc).__name__
        result["message"] = str(exc)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def pin_fails(root: str, world: int, rank: int, result: dict[str, Any]) -> None:
    """Save step 1 while rank 1's pin cannot be written (its storage fails before the
    commit begins); records each rank's error and how long its save took."""
    from checkpointd.errors import StorageError
    from checkpointd.write import incremental

    if rank == 1:

        def write_pin(*args: Any) -> str:
            raise StorageError(5, "injected: the pin could not be written")

        incremental.write_pin = write_pin  # type: ignore[assignment]
    model, optimizer = build(world, seed=0)
    train_step(model, optimizer, seed=1)
    started = time.perf_counter()
    try:
        with checkpointd.CheckpointWriter(root, incremental=True) as writer:
            writer.save(1, {"model": model, "optimizer": optimizer}).result()
    except checkpointd.CheckpointError as exc:
        result["save_error"] = [type(exc).__name__, str(exc)]
    result["seconds"] = time.perf_counter() - started


if __name__ == "__main__":
    main()
