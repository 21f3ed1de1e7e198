"""Training throughput over a window that contains a save, against the same window without.

What a user sees: a CPU language-model training loop (token embedding, pre-norm
transformer blocks, AdamW) counts tokens per second over windows of the same
number of steps. A save window calls ``save()`` at its first step (the blocked
time counts) and, after its last step, waits for the save to be durable (any wait
counts too); an idle window saves nothing. The saved state is the loop's model
and optimizer plus a frozen model of ``--frozen-mb`` MB (a large model's weights,
so a save is in flight for seconds on a CPU). Save windows rotate over the
writer kinds (by default the in-process writer and the service at its default
priority; ``--kinds`` adds the writer's threads or the service at other
priorities, and a service run from another source tree, ``--before SRC``, e.g. a
worktree of an older commit, for a before/after comparison in one run), each
with an idle window beside it (before it in even rounds, after it in odd ones).
Every figure is a median over windows of a kind with [min..max]; the ratio to
idle is given both as a ratio of medians and as the median of each save
window's ratio to its own idle neighbour (on a shared machine, whose load drifts
over minutes, the paired one is the steadier). Each window also records the CPU
seconds this process and the kind's service spent in it.

The window's length is ``--window-steps``, or by default as many steps as take
``--window-seconds`` (5) with nothing in flight, and never fewer than 1.2 times
the steps the slowest writer's save is in flight for (measured after the warm-up
saves): each window holds a whole save. So that a long window does not hide what
the save itself costs, each save window also reports the throughput over the
save's own span (from ``save()`` to the end of the first step that finds it
durable) against the idle windows'.

``python -m benchmarks.bench_window [--frozen-mb 604] [--rounds 9] [--kinds KIND ...]
[--before SRC] [--json FILE]``; ``--smoke``: a tiny model, one round.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import checkpointd
from benchmarks.common import (
    MiB,
    Table,
    flat_state,
    pick_folder,
    repo_env,
    start_service,
    work_dir,
)

WARMUP = 2
"""Saves per writer before any window (the first ones allocate segments and buffers)."""

MIN_WINDOW_STEPS = 10
"""The shortest measured window (a save done within a step or two still gets ten)."""

KINDS: dict[str, tuple[tuple[str, ...] | None, dict[str, Any]]] = {
    "inproc": (None, {}),
    "inproc_nice0": (None, {"background_niceness": 0}),
    "inproc_nice19": (None, {"background_niceness": 19}),
    "service": ((), {}),
    "service_nice0": (("--niceness", "0", "--io-priority", "none"), {}),
    "service_nice19": (("--niceness", "19"), {}),
    "service_before": ((), {}),
}
"""Writer kinds: (None: in-process, else the service's arguments; the writer's options).
``service_before`` is a service run from the ``--before`` source tree."""

DEFAULT_KINDS = ("inproc", "service")

GOALS = {"inproc": 0.90, "service": 0.95}
"""Window throughput with a save / without, per writer kind (issue 35)."""


@dataclass(frozen=True)
class Shape:
    """The training loop: model size and tokens per step."""

    vocab: int = 4096
    d: int = 256
    layers: int = 2
    heads: int = 4
    batch: int = 4
    seq: int = 64

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


SMOKE = Shape(vocab=256, d=32, layers=1, heads=2, batch=2, seq=16)


class TinyLM(torch.nn.Module):
    """A causal language model: embedding, ``layers`` pre-norm blocks, a vocabulary head."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(shape.vocab, shape.d)
        block = torch.nn.TransformerEncoderLayer(
            shape.d, shape.heads, 4 * shape.d, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = torch.nn.TransformerEncoder(block, shape.layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(shape.d, shape.vocab)
        self.register_buffer(
            "mask", torch.nn.Transformer.generate_square_subsequent_mask(shape.seq), False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.blocks(self.embed(tokens), mask=self.mask, is_causal=True)
        out: torch.Tensor = self.head(hidden)
        return out


class Trainer:
    """The loop and its state; ``step()`` trains on one batch of random tokens."""

    def __init__(self, shape: Shape, frozen_bytes: int) -> None:
        torch.manual_seed(0)
        self.shape = shape
        self.model = TinyLM(shape)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.state = {
            "model": self.model,
            "optimizer": self.optimizer,
            "frozen": flat_state(frozen_bytes),
        }
        self.batches = [
            torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1)) for _ in range(4)
        ]
        self.steps = 0

    def step(self) -> None:
        batch = self.batches[self.steps % len(self.batches)]
        self.steps += 1
        logits = self.model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, self.shape.vocab), batch[:, 1:].reshape(-1)
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()


def _window(
    trainer: Trainer, steps: int, writer: checkpointd.CheckpointWriter | None, step: int
) -> dict[str, float]:
    """One window of ``steps`` training steps, with a save of ``step`` by ``writer`` at its
    start (None: no save): tokens per second over the whole window; with a save also over
    the save's own span (from ``save()`` to the end of the first step that finds it done),
    and the save's times."""
    started = time.perf_counter()
    handle = None if writer is None else writer.save(step, trainer.state)
    blocked = time.perf_counter() - started
    span_steps, span_end = 0, 0.0
    for _ in range(steps):
        trainer.step()
        if handle is not None and not span_end:
            span_steps += 1
            if handle.done():
                span_end = time.perf_counter()
    waited = time.perf_counter()
    if handle is not None:
        handle.result(600)
    ended = time.perf_counter()
    out = {"tokens_per_s": steps * trainer.shape.tokens / (ended - started)}
    if handle is not None:
        assert handle.durable_seconds is not None
        span_end = span_end or ended
        out |= {
            "span_tokens_per_s": span_steps * trainer.shape.tokens / (span_end - started),
            "blocked": blocked,
            "durable": handle.durable_seconds,
            "waited": ended - waited,
            "in_flight_steps": float(span_steps),
        }
    return out


def _steps_in_flight(trainer: Trainer, writer: checkpointd.CheckpointWriter, step: int) -> int:
    """Training steps taken while one save of ``step`` is in flight (``save()`` included)."""
    handle = writer.save(step, trainer.state)
    steps = 0
    while not handle.done():
        trainer.step()
        steps += 1
    handle.result(600)
    return steps


_SERVICE_PIDS: dict[str, int] = {}


def _cpu_seconds(kind: str | None) -> float:
    """CPU seconds so far of this process (every thread: the in-process writer's too) and,
    for a service kind, of its service process."""
    times = os.times()
    total = times.user + times.system
    pid = _SERVICE_PIDS.get(kind or "")
    if pid is not None:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _idle_step(trainer: Trainer, steps: int = 9) -> float:
    """The median seconds of a training step with nothing in flight."""
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        trainer.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@contextlib.contextmanager
def _services(
    kinds: dict[str, tuple[str, ...] | None], before: str | None
) -> Iterator[dict[str, str]]:
    """A service per kind (default arguments, or those given; ``service_before`` run from
    ``before``'s tree), yielding each one's socket."""
    _SERVICE_PIDS.clear()
    folders: list[str] = []
    procs = []
    sockets: dict[str, str] = {}
    try:
        for name, args in kinds.items():
            if args is None:
                continue
            folder = tempfile.mkdtemp(prefix="ckd-window-", dir="/tmp")
            folders.append(folder)
            env = repo_env(before) if name == "service_before" and before else None
            procs.append(start_service(folder, *args, env=env))
            sockets[name] = os.path.join(folder, "sock")
            _SERVICE_PIDS[name] = procs[-1].pid
        yield sockets
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(60)
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)


def run(
    folder: Path,
    *,
    shape: Shape,
    frozen_bytes: int,
    rounds: int,
    window_steps: int | None = None,
    window_seconds: float = 5.0,
    warmup: int = WARMUP,
    kinds: tuple[str, ...] = DEFAULT_KINDS,
    before: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every window, interleaved; the series, the window's steps and the ratios."""
    trainer = Trainer(shape, frozen_bytes)
    table = Table()
    with _services({name: KINDS[name][0] for name in kinds}, before) as sockets:
        writers = {
            name: checkpointd.CheckpointWriter(
                str(folder / name), keep_last=1, service=sockets.get(name), **KINDS[name][1]
            )
            for name in kinds
        }
        try:
            for _ in range(5):
                trainer.step()
            saves = 0
            for writer in writers.values():
                for _ in range(warmup):
                    writer.save(saves, trainer.state).result(600)
                    saves += 1
            if window_steps is None:
                longest = 0
                for writer in writers.values():
                    longest = max(longest, _steps_in_flight(trainer, writer, saves))
                    saves += 1
                idle_step = _idle_step(trainer)
                window_steps = max(
                    MIN_WINDOW_STEPS,
                    math.ceil(window_seconds / idle_step),
                    math.ceil(1.2 * longest),
                )
            log(
                f"[window] {window_steps} steps of {shape.tokens} tokens per window,"
                f" state {sum(t.numel() * 4 for t in trainer.state['frozen'].values()) / 1e6:.0f}"
                f" MB frozen + the model and AdamW; {rounds} rounds"
            )
            names = list(writers)
            for round_ in range(rounds):
                shift = round_ % len(names)
                for name in names[shift:] + names[:shift]:
                    # Each save window has an idle window beside it (before it in one
                    # round, after it in the next): their ratio is the pair's.
                    pair: dict[str, float] = {}
                    for kind in (name, None) if round_ % 2 else (None, name):
                        cpu = _cpu_seconds(kind)
                        writer = None if kind is None else writers[kind]
                        result = _window(trainer, window_steps, writer, saves)
                        result["cpu"] = _cpu_seconds(kind) - cpu
                        saves += kind is not None
                        for key, value in result.items():
                            table.add(f"{kind or 'idle'}.{key}", value)
                        pair[kind or "idle"] = result["tokens_per_s"]
                    table.add(f"{name}.paired_ratio", pair[name] / pair["idle"])
                log(f"  round {round_ + 1}/{rounds} done")
        finally:
            for writer in writers.values():
                writer.close()
    idle = table["idle.tokens_per_s"].median
    ratios = {name: table[f"{name}.tokens_per_s"].median / idle for name in kinds}
    span_ratios = {name: table[f"{name}.span_tokens_per_s"].median / idle for name in kinds}
    paired = {name: table[f"{name}.paired_ratio"].median for name in kinds}
    return {
        "window_steps": window_steps,
        "tokens_per_step": shape.tokens,
        "state_bytes": frozen_bytes,
        "series": table.as_json(),
        "ratios": ratios,
        "span_ratios": span_ratios,
        "paired_ratios": paired,
        "table": table,
    }


def report(results: dict[str, Any]) -> list[str]:
    """The figures, one line each: tokens/s per kind, save times and ratios to idle."""
    table: Table = results["table"]
    lines = [
        f"throughput over a window of {results['window_steps']} steps"
        " (medians [min..max] over windows, interleaved):"
    ]
    for name in ("idle", *results["ratios"]):
        series = table[f"{name}.tokens_per_s"]
        line = (
            f"  {name:<15} {series.median:9.0f} tokens/s"
            f" [{min(series.values):.0f}..{max(series.values):.0f}]"
        )
        if name != "idle":
            ratio = results["ratios"][name]
            goal = GOALS.get(name)
            mark = (
                "" if goal is None else ("  ok" if ratio >= goal else f"  MISSED (goal >= {goal})")
            )
            line += (
                f"  {ratio:5.3f}x idle{mark} (paired with the idle window beside it:"
                f" {results['paired_ratios'][name]:5.3f}x); save blocked {table[f'{name}.blocked'].median:.3f} s,"
                f" durable {table[f'{name}.durable'].median:.2f} s,"
                f" in flight {table[f'{name}.in_flight_steps'].median:.0f} steps,"
                f" waited after the window {table[f'{name}.waited'].median:.3f} s;"
                f" over the save's own span {results['span_ratios'][name]:5.3f}x idle;"
                f" CPU seconds per window {table[f'{name}.cpu'].median:.2f}"
                f" (idle {table['idle.cpu'].median:.2f}; the service's included)"
            )
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frozen-mb", type=float, default=604, help="frozen weights' MB")
    parser.add_argument("--rounds", type=int, default=9, help="windows of each kind")
    parser.add_argument("--window-steps", type=int, help="steps per window (default: measured)")
    parser.add_argument(
        "--window-seconds", type=float, default=5.0, help="idle seconds a window lasts at least"
    )
    parser.add_argument(
        "--kinds",
        nargs="+",
        choices=list(KINDS),
        default=list(DEFAULT_KINDS),
        help="writer kinds (default: inproc service); nice0/nice19: the writer's threads or"
        " the service at that niceness; service_before: a service run from --before",
    )
    parser.add_argument("--before", metavar="SRC", help="the src folder service_before runs")
    parser.add_argument("--dir", help="folder to write in (default $CHECKPOINTD_BENCH_DIR or /tmp)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and state, one round")
    args = parser.parse_args(argv)
    shape = SMOKE if args.smoke else Shape()
    frozen = 1 * MiB if args.smoke else int(args.frozen_mb * 1e6)
    rounds = 1 if args.smoke else args.rounds
    with work_dir(pick_folder(args.dir, 0), "window") as folder:
        results = run(
            folder,
            shape=shape,
            frozen_bytes=frozen,
            rounds=rounds,
            window_steps=4 if args.smoke else args.window_steps,
            window_seconds=args.window_seconds,
            warmup=1 if args.smoke else WARMUP,
            kinds=tuple(args.kinds),
            before=args.before,
            log=lambda line: print(line, flush=True),
        )
    print(f"load average {os.getloadavg()}")
    print("\n".join(report(results)))
    if args.json:
        Path(args.json).write_text(
            json.dumps({k: v for k, v in results.items() if k != "table"}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
