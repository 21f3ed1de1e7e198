"""The figures of ``benchmarks.gpu_check``: one model with its AdamW state on a device,
saved and restored by every contender, interleaved, repetition by repetition.

On CUDA the state is ``--gb`` GB (parameters + AdamW moments); without CUDA the same
code runs on CPU at toy size (a rehearsal that keeps this module tested in CI; its
figures are no goal's). Series (seconds, medians in the results):

- ``d2h.pinned``: the state's tensors copied one by one into one pinned buffer with
  non-blocking ``torch.cuda`` copies, synchronized once (the bytes ``save()`` stages);
  ``d2h.single``: one copy of one device tensor of the same size (the copy floor).
- ``blocking.*``, ``overlapped.*``, ``service.*``: ``save()`` blocked, ``staged``
  (until the state is in host memory), ``durable`` (until committed).
- ``dcp.*``: DCP ``async_save`` with its pinned ``DefaultStager`` (torchtitan's
  zero-overhead mode): blocked, staged, durable.
- ``restore.checkpointd`` / ``restore.service`` (from the memory tier) into the live
  device tensors, against ``restore.torch``: ``torch.load(map_location=device)`` then
  ``load_state_dict`` of both; every file in page cache (warm).
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

import checkpointd
from benchmarks.bench_gpu_staging import _dcp_saver, copy_each
from benchmarks.common import Table, nbytes_of, start_service, tensors_of, with_adamw

# What the state is made of: square Linear layers of this width (on CUDA, 8192: 268 MB
# a weight), then AdamW's two moments, 3x the parameters' bytes.
WIDTH = {"cuda": 8192, "cpu": 256}
TOY_BYTES = 24 * 2**20  # the CPU rehearsal's state, and --smoke's on CUDA


def build_state(nbytes: int, device: str) -> dict[str, Any]:
    """A model of Linear layers and its AdamW optimizer, state filled, on ``device``:
    at least ``nbytes`` of parameters and moments together."""
    width = WIDTH["cuda"] if nbytes >= 2**30 and device == "cuda" else WIDTH["cpu"]
    layer = (width * width + width) * 4 * 3
    torch.manual_seed(0)
    layers = [
        torch.nn.Linear(width, width, device=device) for _ in range(math.ceil(nbytes / layer))
    ]
    model = torch.nn.Sequential(*layers)
    return {"model": model, "optimizer": with_adamw(model)}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class _Run:
    """The contenders over one state, each callable once per repetition (any order)."""

    def __init__(self, folder: Path, state: dict[str, Any], device: str, socket: str) -> None:
        self.folder, self.state, self.device, self.socket = folder, state, device, socket
        self.tensors = [t.detach() for t in tensors_of(state)]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors)
        pin = device == "cuda"
        self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        self.whole = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.writers = {
            "blocking": checkpointd.CheckpointWriter(str(folder / "blocking"), keep_last=1),
            "overlapped": checkpointd.CheckpointWriter(
                str(folder / "overlapped"), keep_last=1, staging="overlapped"
            ),
            "service": checkpointd.CheckpointWriter(
                str(folder / "service"), keep_last=1, service=socket
            ),
        }
        self.dcp = _dcp_saver(folder)
        self.number = 0
        self.torch_file = folder / "torch.pt"

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()
        if self.dcp is not None:
            self.dcp[1]()

    def saves(self) -> list[tuple[str, Callable[[], dict[str, float]]]]:
        """The save contenders, by name: each returns its figures in seconds."""
        found = [("d2h", self.d2h)]
        found += [(name, functools.partial(self.save, name)) for name in self.writers]
        if self.dcp is not None:
            found.append(("dcp", self.dcp_save))
        return found

    def restores(self) -> list[tuple[str, Callable[[], dict[str, float]]]]:
        """The restore contenders, by name (run after the saves)."""
        return [
            ("restore", self.restore),
            ("restore", self.restore_torch),
            ("restore", self.restore_service),
        ]

    def d2h(self) -> dict[str, float]:
        pinned = copy_each(self.tensors, self.host)
        _sync(self.device)
        start = time.perf_counter()
        self.host.copy_(self.whole, non_blocking=self.device == "cuda")
        _sync(self.device)
        return {"pinned": pinned, "single": time.perf_counter() - start}

    def save(self, name: str) -> dict[str, float]:
        self.number += 1
        _sync(self.device)
        start = time.perf_counter()
        handle = self.writers[name].save(self.number, self.state)
        blocked = time.perf_counter() - start
        handle.wait_staged()
        staged = time.perf_counter() - start
        handle.result(600)
        durable = time.perf_counter() - start
        return {"blocked": blocked, "staged": staged, "durable": durable}

    def dcp_save(self) -> dict[str, float]:
        assert self.dcp is not None
        self.number += 1
        _sync(self.device)
        with warnings.catch_warnings():  # one process, no process group: DCP says so
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            start = time.perf_counter()
            staging, upload = self.dcp[0](self.number, self.state)
            blocked = time.perf_counter() - start
            staging.result()
            staged = time.perf_counter() - start
            upload.result()
        durable = time.perf_counter() - start
        shutil.rmtree(self.folder / f"dcp-{self.number}")  # keep the disk from filling up
        return {"blocked": blocked, "staged": staged, "durable": durable}

    def save_torch(self) -> None:
        """The file ``torch.load`` restores from: the same state, ``torch.save``d once."""
        plain = {
            "model": self.state["model"].state_dict(),
            "optimizer": self.state["optimizer"].state_dict(),
        }
        torch.save(plain, self.torch_file)

    def restore(self) -> dict[str, float]:
        start = time.perf_counter()
        checkpointd.restore(str(self.folder / "blocking"), self.state)
        _sync(self.device)
        return {"checkpointd": time.perf_counter() - start}

    def restore_torch(self) -> dict[str, float]:
        start = time.perf_counter()
        loaded = torch.load(self.torch_file, map_location=self.device)
        self.state["model"].load_state_dict(loaded["model"])
        self.state["optimizer"].load_state_dict(loaded["optimizer"])
        _sync(self.device)
        took = time.perf_counter() - start
        del loaded
        return {"torch": took}

    def restore_service(self) -> dict[str, float]:
        start = time.perf_counter()
        info = checkpointd.restore(str(self.folder / "service"), self.state, service=self.socket)
        _sync(self.device)
        took = time.perf_counter() - start
        return {"service": took, "service_from_memory": float(info.source == "memory")}


def measure(nbytes: int, reps: int, deadline: float, parent: Path | None = None) -> dict[str, Any]:
    """Every series (see the module's docstring) over ``reps`` repetitions after one
    warm-up, on CUDA if there is one. Fewer if ``deadline`` (a ``time.monotonic()``)
    would pass: a repetition of the saves starts only if it and two of the restores
    (guessed as long as one of the saves) fit."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        nbytes = min(nbytes, TOY_BYTES)
    table = Table()
    sockets = tempfile.mkdtemp(prefix="ckd-gpu-", dir="/tmp")  # a short socket path
    folder = Path(tempfile.mkdtemp(prefix="checkpointd-bench-gpu-", dir=parent))
    try:
        with ThreadPoolExecutor(1) as pool:  # the service starts while the state is built
            starting = pool.submit(start_service, sockets)  # no memory limit, as by default
            try:
                state = build_state(nbytes, device)
            except BaseException:
                _stop(starting.result())
                raise
        service = starting.result()
        try:
            run = _Run(folder, state, device, os.path.join(sockets, "sock"))
            try:
                done = _repeat(run.saves(), reps, table, lambda took: 3 * took, deadline)
                run.save_torch()
                _repeat(run.restores(), max(done, 1), table, lambda took: took, deadline)
            finally:
                run.close()
        finally:
            _stop(service)
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "state_bytes": nbytes_of(state),
        "tensors": len(run.tensors),
        "reps": done,
        "cache": "warm",
        "series": table.as_json(),
    }


def _repeat(
    contenders: list[tuple[str, Callable[[], dict[str, float]]]],
    reps: int,
    table: Table,
    ahead: Callable[[float], float],
    deadline: float,
) -> int:
    """A warm-up (its series named ``NAME.first.FIGURE``) then up to ``reps`` repetitions
    of every contender, the order rotated each time; the next one starts only if
    ``ahead(seconds the last one took)`` fits before ``deadline``. The repetitions run."""
    for rep in range(reps + 1):
        started = time.monotonic()
        for name, contender in _rotated(contenders, rep):
            for figure, seconds in contender().items():
                table.add(f"{name}.{'first.' if rep == 0 else ''}{figure}", seconds)
        if rep == reps or time.monotonic() + ahead(time.monotonic() - started) > deadline:
            return rep
    return reps


def _stop(service: subprocess.Popen[bytes]) -> None:
    service.terminate()
    service.wait()


def _rotated(items: list[Any], rep: int) -> list[Any]:
    shift = rep % len(items)
    return items[shift:] + items[:shift]
