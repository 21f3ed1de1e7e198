"""One rank of a small FSDP2 job that checkpoints through checkpointd.integrations.torchtitan.

    python -m tests.support.torchtitan_job ACTION ROOT OUT STEPS RANK WORLD PORT

A torchtitan-style loop (torchtitan's own OptimizersContainer, LRSchedulersContainer
and ModelWrapper, driven by CheckpointdManager as torchtitan's Trainer drives its
checkpointer: ``load()`` first, ``save(step, last_step=...)`` after every step) over
an MLP with dropout sharded with ``fully_shard`` on a CPU mesh. The batches come
from torch's global generator and a per-rank data position, so the RNG and the
dataloader state matter. ``run``: load (resume if there is a checkpoint), train to
STEPS; ``die:N``: the same, killing itself with SIGKILL after step N (its saves so
far committed); ``load``: only load. Rank 0 writes OUT/state.pt (full parameters and
optimizer state, gathered) and every rank OUT/rankR.json (``ok``, ``step``,
``loaded``, ``error``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

INTERVAL = 3


class Position:
    """A per-rank data position (what torchtitan's dataloader state is)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.batches = rank, 0

    def state_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches = int(state["batches"])


class TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def _full(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    return value


def main() -> None:
    action, root, out_s, steps_s, rank_s, world_s, port = sys.argv[1:]
    rank, world, steps, out = int(rank_s), int(world_s), int(steps_s), Path(out_s)
    report: dict[str, Any] = {"ok": False}
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        from torchtitan.components.optimizer import LRSchedulersContainer
        from torchtitan.components.optimizer.optimizer import default_adamw

        from checkpointd.integrations.torchtitan import CheckpointdManager

        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )
        for layer in (model[0], model[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizers = default_adamw(lr=0.01, implementation="for-loop").build(model_parts=[model])
        schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=optimizers, training_steps=steps
        )
        train_state, position = TrainState(), Position(rank)
        manager = CheckpointdManager.Config(
            enable=True, folder=root, interval=INTERVAL, keep_latest_k=2, last_save_model_only=False
        ).build(
            dataloader=position,
            model_parts=[model],
            optimizers=optimizers,
            lr_schedulers=schedulers,
            states={"train_state": train_state},
            sd_adapter=None,
        )
        torch.manual_seed(1000 + rank)  # a resumed run must get its streams from the checkpoint
        report["loaded"] = manager.load()
        die_after = int(action.partition(":")[2] or 0)  # "die:N": SIGKILL itself after step N
        while action != "load" and train_state.step < steps:
            train_state.step += 1
            position.batches += 1
            x = torch.randn(4, 8) + position.batches
            loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            loss.backward()
            optimizers.step()
            schedulers.step()
            optimizers.zero_grad()
            manager.save(train_state.step, last_step=train_state.step == steps)
            if train_state.step == die_after:
                manager.wait()
                dist.barrier()
                os.kill(os.getpid(), signal.SIGKILL)
        manager.wait()
        state = {
            "model": _full(dict(model.state_dict())),
            "optimizer": _full(optimizers.state_dict()),
            "lr_last_epoch": torch.tensor(schedulers.state_dict()["last_epoch"]),
            "step": torch.tensor(train_state.step),
        }
        manager.close()
        if rank == 0:
            torch.save(state, out / "state.pt")
        report.update(ok=True, step=train_state.step, batches=position.batches)
    except BaseException:
        report["error"] = traceback.format_exc()
    finally:
        (out / f"rank{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
