"""A 🤗 Trainer run on CPU saving every N steps: CheckpointdTrainer vs Trainer's own saving.

Run: ``python -m benchmarks.bench_transformers [--steps 40 --every 10 --width 256]``.
The same ``Trainer.train`` (a GPT-2 of ``--layers`` x ``--width`` built from a
config, AdamW, ``save_steps=--every``, ``save_total_limit=2``) runs with
``transformers.Trainer`` (its ``checkpoint-N`` folders: safetensors weights,
torch.save'd optimizer, scheduler and RNG, trainer_state.json) and with
``CheckpointdTrainer``, alternating, ``--repeat`` times each. Prints the median
whole-run time (``train`` returns once every save is durable) and the median
time a save held the training loop, with ratios to Trainer's own.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from typing import Any

from benchmarks.framework_runs import print_table, summarize

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

TRAINERS = ("trainer", "checkpointd")
VOCAB, LENGTH = 512, 32


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, samples: int) -> None:
        self.ids = torch.randint(
            0, VOCAB, (samples, LENGTH), generator=torch.Generator().manual_seed(0)
        )

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train_once(
    kind: str, output_dir: str, *, steps: int, every: int, width: int, layers: int
) -> dict[str, Any]:
    """One run; returns its total seconds, the seconds each save held the loop, bytes/save."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from checkpointd.integrations.transformers import CheckpointdTrainer

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=LENGTH, n_embd=width, n_layer=layers, n_head=4,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        max_steps=steps,
        save_strategy="steps",
        save_steps=every,
        save_total_limit=2,
        logging_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    cls = Trainer if kind == "trainer" else CheckpointdTrainer
    trainer = cls(model=model, args=args, train_dataset=_Tokens(2 * steps))
    blocked: list[float] = []
    save = trainer._save_checkpoint

    def timed(*a: Any, **kw: Any) -> None:
        start = time.perf_counter()
        save(*a, **kw)
        blocked.append(time.perf_counter() - start)

    trainer._save_checkpoint = timed  # type: ignore[method-assign]
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    total = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    return {"train": total, "blocked": blocked, "mib": params * 4 * 3 / 2**20}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in TRAINERS}
    with tempfile.TemporaryDirectory(prefix="checkpointd-bench-") as work:
        for r in range(args.repeat):
            for kind in TRAINERS:
                run = train_once(
                    kind,
                    f"{work}/{kind}-{r}",
                    steps=args.steps,
                    every=args.every,
                    width=args.width,
                    layers=args.layers,
                )
                runs[kind].append(run)
    summary = summarize(runs, "train", "train_s")
    mib = runs["trainer"][0]["mib"]
    print(
        f"Trainer.train, {args.steps} steps, a save every {args.every} "
        f"(~{mib:.0f} MiB each: weights + AdamW), median of {args.repeat}"
    )
    names = {"trainer": "Trainer (its own)", "checkpointd": "CheckpointdTrainer"}
    print_table(summary, key="train_s", base="trainer", first_column="saving", names=names)
    return summary


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    main()
