"""A tiny 🤗 Trainer job for checkpointd.integrations.transformers: ``python -m tests.support.transformers_job``.

A 2-layer GPT-2 built from a config (no download), with dropout so the RNG
matters, on a small synthetic dataset. Importable (``fit``) for in-process runs
and runnable as a script for fresh processes: ``--kill-after N`` waits until the
saves made so far are committed, prints ``READY <step>`` and sleeps, for the test
to kill it with SIGKILL mid-epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

SAMPLES, LENGTH, VOCAB = 48, 12, 64


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Fixed random token sequences; the labels are the inputs (causal LM)."""

    def __init__(self) -> None:
        data = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, LENGTH), generator=data)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def model(width: int = 32, layers: int = 2) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=LENGTH,
        n_embd=width,
        n_layer=layers,
        n_head=2,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        bos_token_id=0,
        eos_token_id=0,
        loss_type="ForCausalLM",
    )
    return GPT2LMHeadModel(config)


def arguments(output_dir: str, **overrides: Any) -> Any:
    from transformers import TrainingArguments

    options: dict[str, Any] = {
        "output_dir": output_dir,
        "per_device_train_batch_size": 4,
        "num_train_epochs": 2,
        "learning_rate": 1e-3,
        "warmup_steps": 2,
        "save_strategy": "steps",
        "save_steps": 4,
        "save_total_limit": 2,
        "logging_steps": 3,
        "report_to": "none",
        "use_cpu": True,
        "seed": 42,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }
    options.update(overrides)
    return TrainingArguments(**options)


def trainer(
    output_dir: str,
    *,
    io: str = "checkpointd",
    root: str | None = None,
    storage_options: dict[str, Any] | None = None,
    width: int = 32,
    layers: int = 2,
    callbacks: list[Any] | None = None,
    **overrides: Any,
) -> Any:
    """A Trainer over the tiny model: ``io`` checkpointd (CheckpointdTrainer) or torch
    (plain Trainer, its own checkpoints)."""
    from transformers import Trainer

    from checkpointd.integrations.transformers import CheckpointdTrainer

    kwargs: dict[str, Any] = {
        "model": model(width, layers),
        "args": arguments(output_dir, **overrides),
        "train_dataset": Tokens(),
        "callbacks": callbacks,
    }
    if io == "torch":
        return Trainer(**kwargs)
    options = {"storage_options": storage_options} if storage_options else None
    return CheckpointdTrainer(**kwargs, checkpointd_root=root, checkpointd_options=options)


def result(trained: Any) -> dict[str, torch.Tensor]:
    """What the tests compare: parameters, optimizer state, scheduler and step."""
    out = {f"model.{k}": v.detach().clone() for k, v in trained.model.state_dict().items()}
    optimizer = trained.optimizer.state_dict()
    for index, slots in optimizer["state"].items():
        for name, value in slots.items():
            out[f"optimizer.{index}.{name}"] = torch.as_tensor(value).clone()
    out["scheduler.last_epoch"] = torch.tensor(trained.lr_scheduler.last_epoch)
    out["global_step"] = torch.tensor(trained.state.global_step)
    losses = [row["loss"] for row in trained.state.log_history if "loss" in row]
    out["logged_losses"] = torch.tensor(losses, dtype=torch.float64)
    return out


class _StopAfter:
    """Callback: after ``step``, wait for the saves so far to commit, say READY, sleep."""

    def __new__(cls, step: int) -> Any:
        from transformers import TrainerCallback

        import checkpointd

        handles: list[checkpointd.SaveHandle] = []  # every save the trainer makes
        real_save = checkpointd.CheckpointWriter.save

        def save(self: checkpointd.CheckpointWriter, *args: Any, **kwargs: Any) -> Any:
            handles.append(real_save(self, *args, **kwargs))
            return handles[-1]

        checkpointd.CheckpointWriter.save = save

        class StopAfter(TrainerCallback):  # type: ignore[misc]
            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                if state.global_step == step:
                    for handle in handles:
                        handle.result()
                    print(f"READY {state.global_step}", flush=True)
                    time.sleep(600)

        return StopAfter()


def fit(
    output_dir: str,
    *,
    resume: Any = None,
    kill_after: int | None = None,
    **options: Any,
) -> dict[str, torch.Tensor]:
    callbacks = []
    if kill_after is not None:
        callbacks.append(_StopAfter(kill_after))
    trained = trainer(output_dir, callbacks=callbacks, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trained.train(resume_from_checkpoint=resume)
    return result(trained)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--out")
    parser.add_argument("--kwargs", default="{}", help="JSON keyword arguments of fit()")
    args = parser.parse_args(argv)
    trained = fit(args.output_dir, **json.loads(args.kwargs))
    if args.out:
        torch.save(trained, args.out)
    print("DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
