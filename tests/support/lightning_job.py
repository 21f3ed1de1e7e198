"""A tiny Lightning job for the plugin's tests: ``python -m tests.support.lightning_job``.

Importable (``fit``) for in-process runs and runnable as a script for fresh
processes (resume, kill -9). Uses ``pytorch_lightning``, or ``lightning.pytorch``
with ``--flavour lightning``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset


def flavour(name: str = "pytorch_lightning") -> Any:
    """The Lightning package to train with: ``pytorch_lightning`` or ``lightning.pytorch``."""
    return importlib.import_module("lightning.pytorch" if name == "lightning" else name)


def make_module(pl: Any) -> Any:
    class Tiny(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            # A fixed, decreasing score per step: which checkpoints top-k keeps is known.
            self.log("score", -float(self.global_step), on_step=True, on_epoch=False)
            return loss

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=0.01)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 3, gamma=0.5)]

    return Tiny()


def loader() -> DataLoader[Any]:
    data = torch.Generator().manual_seed(7)
    x = torch.randn(64, 8, generator=data)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, shuffle=True)


def fit(
    dirpath: str,
    *,
    seed: int = 0,
    max_epochs: int = 2,
    max_steps: int = -1,
    ckpt_path: str | None = None,
    io: str = "checkpointd",
    name: str = "pytorch_lightning",
    checkpoint: dict[str, Any] | None = None,
    io_options: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Seed, build, fit; return the trained parameters. ``io``: checkpointd or torch."""
    pl = flavour(name)
    pl.seed_everything(seed, verbose=False)
    module = make_module(pl)
    plugins = []
    if io == "checkpointd":
        from checkpointd.integrations.lightning import CheckpointdIO

        plugins.append(CheckpointdIO(**(io_options or {})))
    callback = pl.callbacks.ModelCheckpoint(dirpath=dirpath, **(checkpoint or {"save_last": True}))
    trainer = pl.Trainer(
        max_epochs=max_epochs,
        max_steps=max_steps,
        plugins=plugins,
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(module, loader(), ckpt_path=ckpt_path)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dirpath")
    parser.add_argument("--out")
    parser.add_argument("--kwargs", default="{}", help="JSON keyword arguments of fit()")
    args = parser.parse_args(argv)
    params = fit(args.dirpath, **json.loads(args.kwargs))
    if args.out:
        torch.save(params, args.out)
    print("DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
