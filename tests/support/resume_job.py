"""A small training job for the exact-resume proof, run as a subprocess.

    python -m tests.support.resume_job ROOT OUT --steps N [--kill-after K] [--wrap]

Trains to step N, saving every 5 steps to ROOT, resuming from ROOT's newest
checkpoint if there is one. It draws from every random domain a job uses:
dropout and noise (torch's global generator), a shuffled DataLoader with its
own torch.Generator, Python ``random``, NumPy's global generator and a NumPy
``default_rng`` Generator. With ``--kill-after K`` it waits for the step-K
save to be durable, trains three more steps and dies with ``os._exit`` (a
preemption: nothing after K may survive). It writes what it saw and where it
ended to OUT (torch.save) before exiting.
"""

from __future__ import annotations

import argparse
import os
import random
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import checkpointd

SAVE_EVERY = 5
KILL_EXIT_CODE = 17


class Numbers(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """96 fixed samples; each item carries its index so the batch order can be compared."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(96, 8, generator=g)
        self.y = self.x[:, :2].sum(dim=1, keepdim=True).tanh()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class TiedNet(nn.Module):
    """A model with dropout and a tied weight (``out.weight is inp.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.hidden = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.25)
        self.head = nn.Linear(16, 8)
        self.out = nn.Linear(8, 8)
        self.out.weight = self.inp.weight
        self.final = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.hidden(torch.relu(self.inp(x)))))
        return self.final(torch.relu(self.out(self.head(h))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--kill-after", type=int, default=None)
    parser.add_argument("--wrap", action="store_true", help="train a DataParallel-wrapped model")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    random.seed(1)
    np.random.seed(2)
    net = TiedNet()
    model: nn.Module = nn.DataParallel(net) if args.wrap else net
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.7)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=4)
    loader_generator = torch.Generator().manual_seed(3)
    loader = DataLoader(
        Numbers(), batch_size=8, shuffle=True, generator=loader_generator, num_workers=0
    )
    label_rng = np.random.default_rng(4)  # a NumPy Generator the job owns (PCG64, 128-bit state)
    progress = checkpointd.TrainingProgress()
    state: dict[str, Any] = {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "scaler": scaler,
        "loader_generator": loader_generator,
        "label_rng": label_rng,
        "rng": checkpointd.RNGState(),
        "progress": progress,
    }
    resumed_from = -1
    if checkpointd.list_checkpoints(args.root):
        resumed_from = checkpointd.restore(args.root, state).step
        assert net.out.weight is net.inp.weight, "tied weights came back untied"

    batches: list[list[int]] = []
    stop = args.steps if args.kill_after is None else args.kill_after + 3
    with checkpointd.CheckpointWriter(args.root) as writer:
        while progress.step < stop:
            for x, y, index in progress.epoch_batches(loader, loader_generator):
                batches.append(index.tolist())
                loss = _train_step(state, x, y)
                progress.record(samples=len(index), loss=loss)
                if progress.step % SAVE_EVERY == 0:
                    handle = writer.save(progress.step, state)
                    if progress.step == args.kill_after:
                        handle.result(timeout=60)
                if progress.step >= stop:
                    break
            if args.kill_after is not None and progress.step >= stop:
                _write(args.out, state, batches, resumed_from)
                os._exit(KILL_EXIT_CODE)  # preempted: no clean shutdown
    _write(args.out, state, batches, resumed_from)


def _train_step(state: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> float:
    """One step that draws from every random domain; returns the loss."""
    inputs = x * (1.0 + 0.05 * random.random())  # Python random
    inputs = inputs + 0.01 * torch.randn_like(inputs)  # torch's global generator (and dropout)
    noise = np.random.normal(0, 0.01, size=tuple(y.shape))  # NumPy's global generator
    targets = y + torch.from_numpy(noise).float() + float(state["label_rng"].uniform(-0.01, 0.01))
    optimizer, scaler = state["optimizer"], state["scaler"]
    loss = nn.functional.mse_loss(state["model"](inputs), targets)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    state["scheduler"].step()
    return float(loss.item())


def _write(out: str, state: dict[str, Any], batches: list[list[int]], resumed_from: int) -> None:
    """What the test compares: final weights, optimizer state, batches, RNG draws after."""
    net = state["model"].module if isinstance(state["model"], nn.DataParallel) else state["model"]
    result = {
        "resumed_from": resumed_from,
        "batches": batches,
        "params": {k: v.clone() for k, v in net.state_dict().items()},
        "optimizer": state["optimizer"].state_dict(),
        "scheduler": state["scheduler"].state_dict(),
        "progress": state["progress"].state_dict(),
        "scale": state["scaler"].get_scale(),
        # One more draw from every generator: equal draws mean equal generator states.
        "next_draws": [
            random.random(),
            float(np.random.random()),
            torch.rand(4),
            float(state["label_rng"].random()),
            torch.rand(4, generator=state["loader_generator"]),
        ],
    }
    torch.save(result, out)


if __name__ == "__main__":
    main()
