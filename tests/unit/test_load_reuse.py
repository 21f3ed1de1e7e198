"""load() in a process that lives on: a loaded file's memory, once its tensors are freed,
is kept for the next load (no page faults again), given back to the OS after a while,
and let go before a load that it does not fit allocates (peak RSS as without keeping)."""

from __future__ import annotations

import contextlib
import gc
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import checkpointd
from checkpointd import tunables

MIB = 2**20


@pytest.fixture(autouse=True)
def no_gc() -> Iterator[None]:
    # A training loop seldom runs the collector between loads: what a load returns must
    # be freed by reference counting alone.
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def _save(root: Path, step: int, mib: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    state = {"w": torch.randn(mib * MIB // 4, generator=generator)}
    with checkpointd.CheckpointWriter(root) as writer:
        writer.save(step, {"model": state}).result()
    return state


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_a_second_load_reads_into_the_memory_the_first_one_freed(tmp_path: Path) -> None:
    _save(tmp_path, 1, 64, seed=1)
    first = checkpointd.load(tmp_path)
    del first
    newer = _save(tmp_path, 2, 64, seed=2)
    before = _faults()
    second = checkpointd.load(tmp_path)
    faults = _faults() - before
    # A fresh 64 MiB buffer takes 16384 faults of 4 KiB pages.
    assert faults < 64 * MIB // 4096 // 4, faults
    assert second.info.step == 2
    assert torch.equal(second.state["model"]["w"], newer["w"])


def test_kept_memory_goes_back_to_the_os(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tunables, "KEEP_SECONDS", 0.2)
    _save(tmp_path, 1, 96, seed=1)
    loaded = checkpointd.load(tmp_path)
    holding = _status("VmRSS")
    del loaded
    deadline = time.monotonic() + 10
    while _status("VmRSS") > holding - 80 * MIB and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _status("VmRSS") <= holding - 80 * MIB


def test_a_load_that_fits_no_kept_memory_lets_it_go_first(tmp_path: Path) -> None:
    _save(tmp_path / "small", 1, 64, seed=1)
    big = _save(tmp_path / "big", 1, 128, seed=2)
    small = checkpointd.load(tmp_path / "small")
    del small  # its 64 MiB kept
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    before = _status("VmRSS")
    loaded = checkpointd.load(tmp_path / "big")
    grown = _status("VmHWM") - before
    # The kept 64 MiB go before the 128 MiB are faulted in: 64 MiB more at the peak, not 128.
    assert grown < 100 * MIB, grown / MIB
    assert torch.equal(loaded.state["model"]["w"], big["w"])
