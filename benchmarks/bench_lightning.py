"""A Lightning fit on CPU saving every N steps: CheckpointdIO vs Lightning's own IO, side by side.

Run: ``python -m benchmarks.bench_lightning [--steps 60 --every 10 --width 1024]``.
The same fit (an MLP of ``--layers`` x ``--width`` linear layers, AdamW, a
``ModelCheckpoint(every_n_train_steps=N)`` keeping the newest) runs with
``TorchCheckpointIO`` (Lightning's default), ``AsyncCheckpointIO`` and
``CheckpointdIO``, in rotation, ``--repeat`` times each. Prints the median
total fit time (saves made durable included: ``fit`` returns after teardown)
and the median time a save held the training loop, with ratios to the default.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.framework_runs import print_table, summarize

IOS = ("torch", "async", "checkpointd")


def _module(pl: Any, width: int, layers: int) -> Any:
    class MLP(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (x,) = batch
            return torch.nn.functional.mse_loss(self.net(x), x)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return MLP()


def _plugin(io: str) -> Any:
    from lightning_fabric.plugins import TorchCheckpointIO
    from pytorch_lightning.plugins.io import AsyncCheckpointIO

    if io == "torch":
        return TorchCheckpointIO()
    if io == "async":
        return AsyncCheckpointIO(TorchCheckpointIO())
    from checkpointd.integrations.lightning import CheckpointdIO

    return CheckpointdIO()


def fit_once(
    io: str, dirpath: str, *, steps: int, every: int, width: int, layers: int
) -> dict[str, Any]:
    """One fit; returns its total seconds and the seconds each save held the loop."""
    import pytorch_lightning as pl

    pl.seed_everything(0, verbose=False)
    plugin = _plugin(io)
    blocked: list[float] = []
    save: Callable[..., None] = plugin.save_checkpoint

    def timed(*args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        save(*args, **kwargs)
        blocked.append(time.perf_counter() - start)

    plugin.save_checkpoint = timed
    data = TensorDataset(torch.randn(64 * 4, width))
    trainer = pl.Trainer(
        max_steps=steps,
        plugins=[plugin],
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=dirpath, every_n_train_steps=every)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    start = time.perf_counter()
    trainer.fit(_module(pl, width, layers), DataLoader(data, batch_size=64))
    return {"fit": time.perf_counter() - start, "blocked": blocked}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {io: [] for io in IOS}
    with tempfile.TemporaryDirectory(prefix="checkpointd-bench-") as work:
        for r in range(args.repeat):
            for io in IOS:
                runs[io].append(
                    fit_once(
                        io,
                        f"{work}/{io}-{r}",
                        steps=args.steps,
                        every=args.every,
                        width=args.width,
                        layers=args.layers,
                    )
                )
    mib = args.layers * (args.width * args.width + args.width) * 4 * 3 / 2**20
    summary = summarize(runs, "fit", "fit_s")
    print(
        f"Lightning fit, {args.steps} steps, a save every {args.every} "
        f"(~{mib:.0f} MiB each: weights + AdamW), median of {args.repeat}"
    )
    names = {
        "torch": "TorchCheckpointIO",
        "async": "AsyncCheckpointIO",
        "checkpointd": "CheckpointdIO",
    }
    print_table(summary, key="fit_s", base="torch", first_column="CheckpointIO", names=names)
    return summary


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    main()
