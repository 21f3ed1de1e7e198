"""A tiny accelerate job for checkpointd.integrations.accelerate's tests: ``python -m tests.support.accelerate_job``.

``run`` trains 2 epochs (``epochs``) of 8 batches (split over the processes); it can
stop after ``save_at`` batches (saving there), save every ``save_every`` batches on the
way (a writer with ``keep_last=2``), or resume from a root first (the loop the
integration's docstring shows: ``batches_done % len(loader)`` picks ``rest_of_epoch``). It returns
the parameters (and a draw from the process's torch generator at the end, which the
RNG restore decides) and the batches it saw. ``--rank R WORLD PORT`` runs it as one
process of a ``WORLD``-process job (gloo on CPU, torch.distributed's env:// rendezvous
on 127.0.0.1, as torchrun or ``accelerate launch`` would set it up).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

EPOCHS, BATCHES = 2, 8


class Counter:
    """A custom object registered for checkpointing."""

    def __init__(self) -> None:
        self.seen = torch.zeros(1)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"].clone()


def run(
    root: str,
    *,
    seed: int = 0,
    save_at: int | None = None,
    resume: bool = False,
    hidden: int = 16,
    epochs: int = EPOCHS,
    save_every: int | None = None,
) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    from checkpointd import CheckpointWriter
    from checkpointd.integrations.accelerate import load_state, rest_of_epoch, save_state

    # One shuffle order for every process (each takes its shard of it): data_seed.
    config = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=seed)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    set_seed(seed, device_specific=True)  # each process its own generators (seed + rank)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, hidden), torch.nn.Dropout(0.2), torch.nn.Linear(hidden, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 3, gamma=0.5)
    data = torch.Generator().manual_seed(7)
    x = torch.randn(BATCHES * 4, 8, generator=data)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    done, seen = 0, []
    per_epoch = len(loader)  # BATCHES over the processes
    # With several processes every one saves and restores (one collective checkpoint).
    with CheckpointWriter(root, keep_last=2) as writer:
        if resume:
            done = load_state(accelerator, writer).metadata["batches_done"]
        while done < epochs * per_epoch:
            batches: Any = loader
            if done % per_epoch:
                batches = rest_of_epoch(accelerator, loader, done % per_epoch)
            for xb, yb in batches:
                seen.append(xb.clone())
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                counter.seen += 1
                done += 1
                if done == save_at or (save_every and done % save_every == 0):
                    save_state(accelerator, writer, done, metadata={"batches_done": done})
                if done == save_at:
                    return {}, seen
    params = {
        k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()
    }
    params["counter"] = counter.seen
    params["rng_draw"] = torch.rand(4)
    return params, seen


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("out")
    parser.add_argument("--kwargs", default="{}")
    parser.add_argument("--rank", nargs=3, type=int, metavar=("RANK", "WORLD", "PORT"))
    args = parser.parse_args(argv)
    if args.rank is not None:
        rank, world, port = args.rank
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    params, seen = run(args.root, **json.loads(args.kwargs))
    out = args.out if args.rank is None else f"{args.out}/rank{args.rank[0]}.pt"
    torch.save({"params": params, "seen": seen}, out)
    import torch.distributed as dist

    if dist.is_initialized():
        # Leaving with gloo's threads still running can abort the interpreter at exit
        # ("terminate called without an active exception"); end the group together.
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
