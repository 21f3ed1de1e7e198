"""Training-step slowdown during a save, writer threads at niceness 0 vs 19, side by side.

Run: ``python -m benchmarks.bench_niceness``. A CPU training loop (4 x 512-wide
linear layers, AdamW, batch 256) saves its state plus a frozen ~600 MB model;
save windows alternate between two writers that differ only in
``background_niceness``, each followed by idle steps. Prints the median step
time during saves against the idle median, and the median time until durable.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch

import checkpointd
from benchmarks.bench_save import model_state

LEVELS = (0, 19)
WINDOWS = 6
IDLE_STEPS = 10


def main() -> None:
    width, batch = 512, 256
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    optimizer = torch.optim.AdamW(model.parameters())
    state = {
        "model": model,
        "optimizer": optimizer,
        "frozen": model_state(False, layers=12, d=1024)["model"],
    }
    x, y = torch.randn(batch, width), torch.randn(batch, width)

    def step() -> float:
        start = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return time.perf_counter() - start

    for _ in range(5):
        step()
    during: dict[int, list[float]] = {level: [] for level in LEVELS}
    durable: dict[int, list[float]] = {level: [] for level in LEVELS}
    idle: list[float] = []
    with tempfile.TemporaryDirectory() as folder:
        writers = {
            level: checkpointd.CheckpointWriter(
                f"{folder}/nice{level}", keep_last=1, background_niceness=level
            )
            for level in LEVELS
        }
        try:
            for writer in writers.values():
                writer.save(0, state).result()  # allocate the staging buffers
            saves = 0
            for window in range(WINDOWS):
                order = LEVELS if window % 2 == 0 else LEVELS[::-1]
                for level in order:
                    saves += 1
                    handle = writers[level].save(saves, state)
                    while not handle.done():
                        during[level].append(step())
                    handle.result()
                    assert handle.durable_seconds is not None
                    durable[level].append(handle.durable_seconds)
                    idle.extend(step() for _ in range(IDLE_STEPS))
        finally:
            for writer in writers.values():
                writer.close()
    idle_median = statistics.median(idle)
    print(f"idle step median {idle_median * 1e3:.1f} ms")
    for level in LEVELS:
        median = statistics.median(during[level])
        print(
            f"background_niceness={level:>2}: step during save {median * 1e3:.1f} ms "
            f"({median / idle_median - 1:+.1%}), durable median {statistics.median(durable[level]):.2f} s"
        )


if __name__ == "__main__":
    main()
