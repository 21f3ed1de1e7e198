"""torchtitan's checkpointer on 2 gloo ranks (CPU, FSDP2): CheckpointdManager vs the DCP one.

Run: ``python -m benchmarks.bench_torchtitan [--width 1024 --layers 4 --steps 20 --every 5]``.
Each manager is built from its ``Config`` and driven as torchtitan's Trainer drives
it (``save(step, last_step=...)`` after every step) over an MLP sharded with
``fully_shard`` and torchtitan's own AdamW container, 2 ranks, in turn. Prints the
median time a save held the loop and the whole run (saves durable at the end:
``wait`` / DCP's synchronous save), with ratios to DCP (``async_mode="disabled"``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.framework_runs import print_table, summarize

MANAGERS = ("dcp", "checkpointd")


def _rank(manager_kind: str, root: str, out: str, numbers: list[int]) -> None:
    """One rank: ``numbers`` are width, layers, steps, every, rank, world, port."""
    width, layers, steps, every, rank, world, port = numbers
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    from checkpointd.integrations.torchtitan import CheckpointdManager

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = default_adamw(lr=1e-4, implementation="foreach").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=steps
    )
    cls: Any = CheckpointManager if manager_kind == "dcp" else CheckpointdManager
    config = cls.Config(
        enable=True, folder=root, interval=every, keep_latest_k=2, last_save_model_only=False
    )
    manager = config.build(dataloader=None, model_parts=[model], optimizers=optimizers,
                           lr_schedulers=schedulers, states={}, sd_adapter=None)  # fmt: skip
    blocked: list[float] = []
    dist.barrier()
    start = time.perf_counter()
    for step in range(1, steps + 1):
        x = torch.randn(16, width)
        torch.nn.functional.mse_loss(model(x), x).backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        began = time.perf_counter()
        if manager.save(step, last_step=step == steps):
            blocked.append(time.perf_counter() - began)
    if manager_kind == "checkpointd":
        manager.wait()
    dist.barrier()
    total = time.perf_counter() - start
    manager.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"total": total, "blocked": blocked}))
    dist.destroy_process_group()


def run_once(kind: str, work: str, args: argparse.Namespace, repeat: int) -> dict[str, Any]:
    import subprocess

    from benchmarks.common import spawn
    from tests.support.launch import free_port

    out = Path(work, f"out-{kind}-{repeat}")
    out.mkdir()
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        spawn(
            [
                sys.executable,
                "-m",
                "benchmarks.bench_torchtitan",
                "--rank-of",
                kind,
                str(Path(work, f"{kind}-{repeat}")),
                str(out),
                str(args.width),
                str(args.layers),
                str(args.steps),
                str(args.every),
                str(rank),
                "2",
                str(port),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for rank in range(2)
    ]
    for proc in procs:
        proc.wait(timeout=600)
    return json.loads(Path(out, "rank0.json").read_text())  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--rank-of":
        kind, root, out, *numbers = argv[1:]
        _rank(kind, root, out, [int(n) for n in numbers])
        return {}
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in MANAGERS}
    with tempfile.TemporaryDirectory(prefix="checkpointd-bench-") as work:
        for r in range(args.repeat):
            for kind in MANAGERS:
                runs[kind].append(run_once(kind, work, args, r))
    summary = summarize(runs, "total", "run_s")
    mib = args.layers * (args.width * args.width + args.width) * 4 * 3 / 2**20
    print(
        f"torchtitan checkpointer, 2 gloo ranks, FSDP2, {args.steps} steps, a save every "
        f"{args.every} (~{mib:.0f} MiB each: weights + AdamW), median of {args.repeat}"
    )
    names = {"dcp": "CheckpointManager", "checkpointd": "CheckpointdManager"}
    print_table(summary, key="run_s", base="dcp", first_column="manager", names=names)
    return summary


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    main()
