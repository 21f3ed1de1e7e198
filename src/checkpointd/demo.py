"""The demo job: train a small model, checkpoint in the background, resume when run again.

Prints, for every save, how long the training loop was blocked and how long
until the checkpoint was durable. Data order is derived from (seed, epoch), and
the loop's progress is saved as a component, so a rerun continues at exactly
the next batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from checkpointd.restore import list_checkpoints, restore
from checkpointd.rng import RNGState
from checkpointd.writer import CheckpointWriter, SaveHandle

__all__ = ["DemoConfig", "run_demo"]


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """What the demo trains and how often it saves."""

    root: str = "checkpoints"
    steps: int = 300
    """Steps to train in this run (a rerun continues from the newest checkpoint)."""
    save_every: int = 50
    steps_per_epoch: int = 100
    width: int = 512
    batch_size: int = 64
    keep_last: int = 3
    seed: int = 0
    storage_options: Mapping[str, Any] | None = None


class Progress:
    """The training loop's own state: where it is, and what it has seen (a Stateful)."""

    def __init__(self) -> None:
        self.step = 0
        self.samples_seen = 0
        self.losses: list[float] = []

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "samples_seen": self.samples_seen, "losses": list(self.losses)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step = int(state["step"])
        self.samples_seen = int(state["samples_seen"])
        self.losses = [float(x) for x in state["losses"]]


def _model(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(32, width),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(width, width),
        nn.GELU(),
        nn.Linear(width, 1),
    )


def _batch(config: DemoConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch number ``step`` of the synthetic data set: a function of (seed, epoch, position)."""
    epoch, position = divmod(step, config.steps_per_epoch)
    order = torch.randperm(
        config.steps_per_epoch, generator=torch.Generator().manual_seed(config.seed * 1000 + epoch)
    )
    sample = torch.Generator().manual_seed(int(order[position]) + 7919 * config.seed)
    x = torch.randn(config.batch_size, 32, generator=sample)
    y = x[:, :4].sum(dim=1, keepdim=True).sin()
    return x, y


def run_demo(config: DemoConfig, out: Callable[[str], None] = print) -> Progress:
    """Train ``config.steps`` more steps, resuming from the newest checkpoint; return progress."""
    torch.manual_seed(config.seed)
    model = _model(config.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.5)
    progress = Progress()
    state = {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "rng": RNGState(),
        "progress": progress,
    }
    existing = list_checkpoints(config.root, storage_options=config.storage_options)
    if existing:
        info = restore(config.root, state, storage_options=config.storage_options)
        out(f"resumed from step {info.step} at {info.path}")
    else:
        out(f"no checkpoint under {config.root}: starting fresh")
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out(f"model: {nbytes / 2**20:.1f} MiB of parameters; saving every {config.save_every} steps")

    pending: list[SaveHandle] = []

    def report(handles: list[SaveHandle]) -> list[SaveHandle]:
        for handle in handles:
            if handle.done():
                info = handle.result()
                assert handle.durable_seconds is not None
                out(
                    f"step {info.step:>6}: blocked {handle.blocked_seconds * 1e3:7.1f} ms, "
                    f"durable after {handle.durable_seconds * 1e3:7.1f} ms, "
                    f"{info.nbytes / 2**20:.1f} MiB"
                )
        return [h for h in handles if not h.done()]

    loss_fn = nn.MSELoss()
    with CheckpointWriter(
        config.root, storage_options=config.storage_options, keep_last=config.keep_last
    ) as writer:
        started = time.perf_counter()
        target = progress.step + config.steps
        while progress.step < target:
            x, y = _batch(config, progress.step)
            model.train()
            loss = loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            progress.step += 1
            progress.samples_seen += x.shape[0]
            progress.losses.append(loss.item())
            if progress.step % config.save_every == 0:
                pending.append(writer.save(progress.step, state, metrics={"loss": loss.item()}))
            if progress.step % config.steps_per_epoch == 0:
                writer.wait()  # epoch boundary: everything saved so far is durable
                out(f"epoch {progress.step // config.steps_per_epoch} done, loss {loss.item():.4f}")
            pending = report(pending)
        writer.wait()
        report(pending)
        out(f"trained to step {progress.step} in {time.perf_counter() - started:.1f} s")
    return progress
