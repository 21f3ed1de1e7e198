"""A tiny accelerate job for checkpointd.accelerate's tests: ``python -m tests.support.accelerate_job``.

``run`` trains 2 epochs of 8 batches; it can stop after ``save_at`` batches (saving
there) or resume from a root first. It returns the parameters and the batches it saw.
"""

from __future__ import annotations

import argparse
import json
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
) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    from checkpointd import CheckpointWriter
    from checkpointd.accelerate import load_state, rest_of_epoch, save_state

    set_seed(seed)
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True)
    )
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
    with CheckpointWriter(root, keep_last=2) as writer:
        if resume:
            done = load_state(accelerator, writer).metadata["batches_done"]
        while done < EPOCHS * BATCHES:
            batches: Any = loader
            if done % BATCHES:
                batches = rest_of_epoch(accelerator, loader, done % BATCHES)
            for xb, yb in batches:
                seen.append(xb.clone())
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                counter.seen += 1
                done += 1
                if done == save_at:
                    save_state(accelerator, writer, done, metadata={"batches_done": done})
                    return {}, seen
    params = {
        k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()
    }
    params["counter"] = counter.seen
    return params, seen


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("out")
    parser.add_argument("--kwargs", default="{}")
    args = parser.parse_args(argv)
    params, seen = run(args.root, **json.loads(args.kwargs))
    torch.save({"params": params, "seen": seen}, args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
