"""The demo job: train a small model, checkpoint in the background, resume when run again.

Prints, for every save, how long the training loop was blocked and how long
until the checkpoint was durable. Everything that decides what happens next is
a component of the checkpoint (model, optimizer, scheduler, every global RNG,
and a ``TrainingProgress`` that carries the epoch, the step, the data order
consumed and the loss history), so a rerun continues exactly where the last
run stopped, mid-epoch included, as if it had never stopped.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from checkpointd.api.restore import restore
from checkpointd.api.writer import CheckpointWriter, SaveHandle
from checkpointd.read.restore import list_checkpoints
from checkpointd.state.progress import TrainingProgress
from checkpointd.state.rng import RNGState
from checkpointd.storage import resolve_root

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
    service: str | None = None
    """Save (and resume) through the checkpoint service at this socket, or "auto"."""


def _model(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(32, width),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(width, width),
        nn.GELU(),
        nn.Linear(width, 1),
    )


def _dataset(config: DemoConfig) -> TensorDataset:
    """A fixed synthetic data set of ``steps_per_epoch`` batches, a function of the seed."""
    g = torch.Generator().manual_seed(7919 + config.seed)
    x = torch.randn(config.steps_per_epoch * config.batch_size, 32, generator=g)
    return TensorDataset(x, x[:, :4].sum(dim=1, keepdim=True).sin())


def _resume(
    config: DemoConfig, state: dict[str, Any], progress: TrainingProgress, batches: int
) -> str:
    """Restore ``state`` from the newest checkpoint, if any; the line saying where the run
    stands (epochs counted from 1, as in "epoch N done")."""
    if not list_checkpoints(config.root, storage_options=config.storage_options):
        return f"no checkpoint under {config.root}: starting fresh"
    info = restore(
        config.root, state, storage_options=config.storage_options, service=config.service
    )
    number = progress.epoch + 1  # the epoch in progress
    if progress.batch_in_epoch == 0:
        where = f"{progress.epoch} epoch(s) done, epoch {number} not started"
    else:
        where = f"in epoch {number}: {progress.batch_in_epoch} of {batches} batches done"
    return f"resumed from step {info.step} at {info.path} from {info.source} ({where})"


def run_demo(config: DemoConfig, out: Callable[[str], None] = print) -> TrainingProgress:
    """Train ``config.steps`` more steps, resuming from the newest checkpoint; return progress.

    Saves every ``save_every`` steps and at the end of the run, waits for
    durability at every epoch boundary. Call from the main thread.
    """
    config = dataclasses.replace(config, root=resolve_root(config.root))  # this folder's
    torch.manual_seed(config.seed)
    model = _model(config.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.5)
    loader_generator = torch.Generator().manual_seed(config.seed)
    loader = DataLoader(
        _dataset(config), batch_size=config.batch_size, shuffle=True, generator=loader_generator
    )
    progress = TrainingProgress()
    state = {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "rng": RNGState(),  # dropout draws from torch's global generator
        "progress": progress,  # epoch, step, batches consumed, loss history, data order
    }
    out(_resume(config, state, progress, len(loader)))
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
    saved = progress.step
    with CheckpointWriter(
        config.root,
        storage_options=config.storage_options,
        keep_last=config.keep_last,
        service=config.service,
    ) as writer:
        started = time.perf_counter()
        target = progress.step + config.steps
        while progress.step < target:
            model.train()
            first = progress.step
            for x, y in progress.epoch_batches(loader, loader_generator):
                loss = loss_fn(model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scheduler.step()
                progress.record(samples=x.shape[0], loss=loss.item())
                if progress.step % config.save_every == 0:
                    pending.append(writer.save(progress.step, state, metrics={"loss": loss.item()}))
                    saved = progress.step
                pending = report(pending)
                if progress.step >= target:
                    break
            else:
                writer.wait()  # epoch boundary: everything saved so far is durable
                if progress.step > first:  # not an epoch the last run trained to its end
                    out(f"epoch {progress.epoch} done, loss {progress.history['loss'][-1]:.4f}")
        if saved != progress.step:  # the run's last steps: a rerun continues from here
            metrics = {"loss": progress.history["loss"][-1]}
            pending.append(writer.save(progress.step, state, metrics=metrics))
        writer.wait()
        report(pending)
        out(f"trained to step {progress.step} in {time.perf_counter() - started:.1f} s")
    return progress
