"""CUDA staging: pinned device-to-host bandwidth against the copy floor, and the training
loop's stall per save for checkpointd (blocking, overlapped) and DCP ``async_save``.

Run: ``python -m benchmarks.bench_gpu_staging`` (``--smoke``: tiny sizes). Without a
CUDA device it prints a message and exits 0.

- Floors: one ``copy_`` of a single device tensor into pinned memory (the
  cudaMemcpy floor), and the state's tensors copied one by one into one pinned
  buffer, non-blocking, synchronized once.
- Staging bandwidth: state bytes / seconds until the state is in host memory:
  ``save()``'s blocked time (blocking), the time until ``handle.staged()``
  (overlapped).
- Stall: an MLP (``--depth`` x ``--width``, AdamW, batch ``--batch``) saves, then
  runs ``--steps`` steps; stall = (save call + those steps) - steps x idle step.
  DCP runs as torchtitan's "zero-overhead" mode: ``async_save`` with a
  ``DefaultStager`` (pinned memory, async staging, non-blocking copies) and a
  wait on its staging future before each ``optimizer.step()`` until it is done.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import checkpointd
from benchmarks.bench_overlap import _record_staged

GB = 10**9


def _sync() -> None:
    torch.cuda.synchronize()


def floors(tensors: list[torch.Tensor], repeats: int) -> dict[str, float]:
    """GB/s of one big D2H copy and of the state's tensors copied one by one."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    big = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    one, each = [], []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        pinned.copy_(big, non_blocking=True)
        _sync()
        one.append(time.perf_counter() - start)
        each.append(copy_each(tensors, pinned))
    del big, pinned
    return {
        "single_copy_gbps": nbytes / statistics.median(one) / GB,
        "per_tensor_gbps": nbytes / statistics.median(each) / GB,
    }


def copy_each(tensors: list[torch.Tensor], host: torch.Tensor) -> float:
    """Seconds to copy ``tensors`` one by one into the uint8 buffer ``host`` (pinned: the
    copies are DMA, non-blocking, synchronized once at the end; CUDA idle before)."""
    cuda = torch.cuda.is_available()
    if cuda:
        _sync()
    start = time.perf_counter()
    offset = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        host[offset : offset + n].view(t.dtype).view(t.shape).copy_(t, non_blocking=cuda)
        offset += n
    if cuda:
        _sync()
    return time.perf_counter() - start


def _loop(width: int, depth: int, batch: int) -> tuple[dict[str, Any], Callable[..., float]]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    x = torch.randn(batch, width, device="cuda")

    def step(before_step: Callable[[], None] | None = None) -> float:
        start = time.perf_counter()
        model(x).square().mean().backward()
        if before_step is not None:
            before_step()
        optimizer.step()
        optimizer.zero_grad()
        _sync()
        return time.perf_counter() - start

    step()
    return {"model": model, "optimizer": optimizer}, step


def _dcp_saver(
    folder: Path,
) -> tuple[Callable[[int, dict[str, Any]], tuple[Any, Any]], Callable[[], None]] | None:
    """A function that starts DCP's zero-overhead async save (returning its staging and
    upload futures) and one that closes its stager; None if DCP lacks them. Without CUDA
    (benchmarks.gpu_check's CPU rehearsal) the stager copies into plain memory, blocking."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save
    except ImportError:
        return None
    cuda = torch.cuda.is_available()
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=cuda,
        )
    )

    def save(step: int, state: dict[str, Any]) -> tuple[Any, Any]:
        plain = {"model": state["model"].state_dict(), "optim": state["optimizer"].state_dict()}
        response = async_save(plain, checkpoint_id=str(folder / f"dcp-{step}"), async_stager=stager)
        if not isinstance(response, AsyncSaveResponse):
            raise RuntimeError("DCP did not stage asynchronously: no staging future")
        return response.staging_completion, response.upload_completion

    return save, stager.close


def _window(
    writer: checkpointd.CheckpointWriter,
    number: int,
    state: dict[str, Any],
    step: Callable[..., float],
    steps: int,
) -> tuple[float, float, float]:
    """One checkpointd save and ``steps`` steps: (blocked, staged, window) seconds."""
    start = time.perf_counter()
    handle = writer.save(number, state)
    blocked = time.perf_counter() - start
    ended: list[float] = []
    watcher = threading.Thread(target=_record_staged, args=(handle, ended))
    watcher.start()
    for _ in range(steps):
        step()
    window = time.perf_counter() - start
    watcher.join()
    handle.result()
    return blocked, ended[0] - start, window


def _dcp_window(
    save: Callable[[int, dict[str, Any]], tuple[Any, Any]],
    number: int,
    state: dict[str, Any],
    step: Callable[..., float],
    steps: int,
) -> tuple[float, float, float]:
    """One DCP async_save and ``steps`` steps, each waiting for staging before
    ``optimizer.step()``: (blocked, staged, window) seconds."""
    start = time.perf_counter()
    staging, upload = save(number, state)
    blocked = time.perf_counter() - start
    ended: list[float] = []
    staging.add_done_callback(lambda _f: ended.append(time.perf_counter()))
    for _ in range(steps):
        step(staging.result)
    window = time.perf_counter() - start
    staging.result()
    staged = (ended[0] if ended else time.perf_counter()) - start
    upload.result()
    return blocked, staged, window


def stalls(
    folder: Path, *, width: int, depth: int, batch: int, windows: int, steps: int
) -> dict[str, Any]:
    """Per mode, the medians of: blocked, staged (seconds), GB/s to staged, stall."""
    state, step = _loop(width, depth, batch)
    nbytes = sum(p.numel() * p.element_size() for p in state["model"].parameters()) * 3
    idle = [step() for _ in range(5)]
    writers = {
        mode: checkpointd.CheckpointWriter(str(folder / mode), keep_last=1, staging=mode)
        for mode in ("blocking", "overlapped")
    }
    dcp = _dcp_saver(folder)
    modes = [*writers, *(["dcp_async_save"] if dcp is not None else [])]
    raw: dict[str, dict[str, list[float]]] = {
        m: {"blocked": [], "staged": [], "stall": []} for m in modes
    }
    number = 0
    try:
        for writer in writers.values():
            number += 1
            writer.save(number, state).result()  # allocate the pinned arenas
        for _ in range(windows + 1):  # the first window warms DCP's stager up
            for mode in modes:
                number += 1
                if mode in writers:
                    blocked, staged, window = _window(writers[mode], number, state, step, steps)
                else:
                    assert dcp is not None
                    blocked, staged, window = _dcp_window(dcp[0], number, state, step, steps)
                    shutil.rmtree(folder / f"dcp-{number}")  # keep the disk from filling up
                if number > len(writers) + len(modes):  # past the warm-up window
                    raw[mode]["blocked"].append(blocked)
                    raw[mode]["staged"].append(staged)
                    raw[mode]["stall"].append(window - steps * statistics.median(idle))
                idle += [step() for _ in range(2)]
    finally:
        for writer in writers.values():
            writer.close()
        if dcp is not None:
            dcp[1]()
    medians = {
        m: {k: statistics.median(v) for k, v in figures.items()} for m, figures in raw.items()
    }
    for figures in medians.values():
        figures["staged_gbps"] = nbytes / figures["staged"] / GB if figures["staged"] else 0.0
    return {"state_gb": nbytes / GB, "idle_step": statistics.median(idle), "median": medians}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one window")
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu_staging: no CUDA device on this machine; nothing measured")
        return 0
    if args.smoke:
        args.width, args.depth, args.batch, args.windows, args.steps = 256, 2, 64, 1, 2
    state, _ = _loop(args.width, args.depth, args.batch)
    tensors = [p.detach() for p in state["model"].parameters()]
    results: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    results["floors"] = floors(tensors, repeats=2 if args.smoke else 5)
    del state, tensors
    with tempfile.TemporaryDirectory(prefix="checkpointd-bench-", dir=args.dir) as folder:
        results["stalls"] = stalls(
            Path(folder),
            width=args.width,
            depth=args.depth,
            batch=args.batch,
            windows=args.windows,
            steps=args.steps,
        )
    print(report(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def report(results: dict[str, Any]) -> str:
    floor = results["floors"]
    stall = results["stalls"]
    rows = [
        f"{results['device']}: state {stall['state_gb']:.2f} GB, idle step "
        f"{stall['idle_step'] * 1e3:.1f} ms",
        f"D2H floor: one copy {floor['single_copy_gbps']:.1f} GB/s, per tensor "
        f"{floor['per_tensor_gbps']:.1f} GB/s",
        f"{'':16}{'blocked':>10}{'staged':>10}{'GB/s':>8}{'stall':>10}",
    ]
    for mode, f in stall["median"].items():
        rows.append(
            f"{mode:16}{f['blocked'] * 1e3:>8.1f}ms{f['staged'] * 1e3:>8.1f}ms"
            f"{f['staged_gbps']:>8.1f}{f['stall'] * 1e3:>8.1f}ms"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    raise SystemExit(main())
