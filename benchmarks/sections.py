"""The sections of the benchmark suite; each returns JSON-able results and prints a summary.

Every section measures its contenders side by side in one process run,
interleaved per repetition, and reports medians with [min..max].
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

import torch

import checkpointd
from benchmarks.bench_save import (
    PEERS_ALL,
    Checkpointd,
    TorchSave,
    compare,
    model_state,
    ratios,
    report,
)
from benchmarks.bench_stall import stall
from benchmarks.common import (
    GB,
    MiB,
    Series,
    Table,
    flat_state,
    fmt_seconds,
    memcpy_floor,
    nbytes_of,
    raw_write_fsync,
    small_tensors,
    tensors_of,
    work_dir,
)
from benchmarks.procwriter import ProcessWriter, write_file
from benchmarks.sections_lived import load, window


@dataclass
class Config:
    """Sizes and repetitions of one suite run (``smoke`` < ``quick`` < full)."""

    mode: str
    folder: Path
    max_bytes: int
    log: Callable[[str], None] = print

    @property
    def smoke(self) -> bool:
        return self.mode == "smoke"

    @property
    def quick(self) -> bool:
        return self.mode in ("smoke", "quick")


# ---------------------------------------------------------------------------
# 1. Large tensors


def large(cfg: Config) -> dict[str, Any]:
    """The 12-layer d=1024 model (~604 MB) and with AdamW (~1.8 GB): every peer, and peak RSS."""
    # (label, with AdamW, layers, d, save reps, load reps, measure peak RSS)
    if cfg.smoke:
        cases = [("model (smoke)", False, 1, 128, 1, 1, False)]
    elif cfg.quick:
        cases = [("model 604 MB", False, 12, 1024, 2, 2, True)]
    else:
        cases = [
            ("model 604 MB", False, 12, 1024, 3, 3, True),
            ("model+AdamW 1.8 GB", True, 12, 1024, 2, 1, False),
        ]
    out: dict[str, Any] = {}
    for label, optimizer, layers, d, reps, load_reps, measure_rss in cases:
        state = model_state(optimizer, layers=layers, d=d)
        nbytes = nbytes_of(state)
        cfg.log(f"[large] {label}: {nbytes / GB:.3f} GB, {reps} reps")
        with work_dir(cfg.folder, "large") as folder:
            table = compare(
                state, folder, reps=reps, peers=PEERS_ALL, load_reps=load_reps, log=cfg.log
            )
        del state
        # Peak RSS is a ratio to the state's size: measured on the 604 MB state only.
        rss = peak_rss(cfg, optimizer, layers, d) if measure_rss else {}
        lines = report(table, nbytes, PEERS_ALL)
        for name, value in rss.items():
            lines.append(
                f"  peak extra RSS {name:<12} {value['extra'] / GB:6.3f} GB"
                f" ({value['extra'] / nbytes:.2f}x state)"
            )
        cfg.log("\n".join(lines))
        out[label] = {
            "nbytes": nbytes,
            "series": table.as_json(),
            "ratios": [{"label": r, "value": v, "goal": g} for r, v, g in ratios(table, PEERS_ALL)],
            "peak_rss": rss,
        }
    return out


def peak_rss(cfg: Config, optimizer: bool, layers: int, d: int) -> dict[str, Any]:
    """Peak extra RSS of each contender's save, each alone in a child process."""
    result: dict[str, Any] = {}
    for name in ("checkpointd", *PEERS_ALL):
        with work_dir(cfg.folder, "rss") as folder:
            cmd = [sys.executable, "-m", "benchmarks.rss", name, "--layers", str(layers)]
            cmd += ["--d", str(d), "--dir", str(folder)] + (["--optimizer"] if optimizer else [])
            done = subprocess.run(
                cmd, capture_output=True, text=True, check=False, cwd=Path(__file__).parent.parent
            )
        if done.returncode != 0:
            cfg.log(f"  peak RSS of {name} failed: {done.stderr.strip().splitlines()[-1:]}")
            continue
        result[name] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# ---------------------------------------------------------------------------
# 2. Many small tensors


def small(cfg: Config) -> dict[str, Any]:
    """20,000 tensors of 1-64 KB: checkpointd against torch.save, per-tensor overhead."""
    count, reps = (300, 1) if cfg.smoke else (20_000, 2 if cfg.quick else 3)
    state = {"optimizer": small_tensors(count)}
    nbytes = nbytes_of(state)
    cfg.log(f"[small] {count} tensors, {nbytes / GB:.3f} GB, {reps} reps")
    table = Table()
    sources = tensors_of(state)
    targets = [torch.empty_like(t) for t in sources]
    with work_dir(cfg.folder, "small") as folder:
        ours, theirs = Checkpointd(state, folder), TorchSave(state, folder)
        try:
            for rep in range(reps):
                table.add("memcpy", memcpy_floor(sources, targets))
                for contender in (ours, theirs) if rep % 2 == 0 else (theirs, ours):
                    timing = contender.save(rep)
                    table.add(f"{contender.name}.blocked", timing.blocked)
                    table.add(f"{contender.name}.durable", timing.durable)
                    if rep < reps - 1:
                        contender.clear()
            for _ in range(reps):
                for contender in (ours, theirs):
                    table.add(f"{contender.name}.load_warm", contender.load())
        finally:
            ours.close()
            theirs.close()
    ratio = table.ratio("checkpointd.durable", "torch.save.durable")
    cfg.log(
        "\n".join(
            [
                f"  memcpy floor              {fmt_seconds(table['memcpy'])}",
                f"  checkpointd blocked       {fmt_seconds(table['checkpointd.blocked'])}",
                f"  checkpointd durable       {fmt_seconds(table['checkpointd.durable'])}",
                f"  torch.save+fsync          {fmt_seconds(table['torch.save.durable'])}",
                f"  checkpointd load          {fmt_seconds(table['checkpointd.load_warm'])}",
                f"  torch.load                {fmt_seconds(table['torch.save.load_warm'])}",
                f"  durable / torch.save      {ratio:6.2f}x "
                + ("ok" if ratio <= 1.0 else "MISSED (goal <= 1.0)"),
            ]
        )
    )
    return {"count": count, "nbytes": nbytes, "series": table.as_json(), "ratio": ratio}


# ---------------------------------------------------------------------------
# 3. Training overhead


class _Mlp(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _busy_window(
    kind: str,
    window: int,
    *,
    step: Callable[[], float],
    writer: checkpointd.CheckpointWriter,
    state: dict[str, Any],
    folder: Path,
    view: memoryview,
    child: ProcessWriter,
    blocked: Series,
    in_flight: Series,
) -> list[float]:
    """Training step times while one writer of ``kind`` writes the state's bytes."""
    steps: list[float] = []
    start = time.perf_counter()
    if kind == "checkpointd":
        handle = writer.save(window, state)
        blocked.add(time.perf_counter() - start)
        while not handle.done():
            steps.append(step())
        handle.result()
        in_flight.add(time.perf_counter() - start)
    elif kind == "thread write":
        thread = threading.Thread(target=write_file, args=(view, str(folder / "thread.bin")))
        thread.start()
        while thread.is_alive():
            steps.append(step())
    else:
        child.start(str(folder / "process.bin"))
        while not child.done():
            steps.append(step())
    return steps


def training(cfg: Config) -> dict[str, Any]:
    """Step times of a CPU training loop with a background save in flight, vs with none.

    The saved state is the loop's own model and optimizer plus a frozen
    ~600 MB model (a large model's weights), so each save is in flight for
    seconds. Windows rotate over three writers of the same bytes (a
    checkpointd save; a bare thread doing direct write + fsync; a child process
    doing the same from shared memory, the process-writer prototype), each
    followed by as many steps with nothing in flight. The capture itself is
    the blocked time, not counted as a step.
    """
    d, batch = (64, 16) if cfg.smoke else (512, 256)
    windows = 1 if cfg.smoke else (3 if cfg.quick else 5)
    model = _Mlp(d)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    frozen = model_state(False, layers=1 if cfg.smoke else 12, d=128 if cfg.smoke else 1024)
    state = {"model": model, "optimizer": optimizer, "frozen": frozen["model"]}
    x, y = torch.randn(batch, d), torch.randn(batch, d)

    def step() -> float:
        start = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return time.perf_counter() - start

    for _ in range(5):
        step()
    nbytes = nbytes_of(state)
    kinds = ("checkpointd", "thread write", "process write")
    idle, blocked, in_flight = Series(), Series(), Series()
    busy = {kind: Series() for kind in kinds}
    shm = SharedMemory(create=True, size=nbytes)
    shm.buf[:nbytes] = os.urandom(nbytes) if nbytes < MiB else bytes(nbytes)
    view = shm.buf[:nbytes]
    child = ProcessWriter(shm, nbytes)
    try:
        with (
            work_dir(cfg.folder, "training") as folder,
            checkpointd.CheckpointWriter(str(folder / "ckpt")) as writer,
        ):
            writer.save(0, state).result()  # allocate the staging buffer
            for window in range(1, windows + 1):
                for kind in kinds[window % 3 :] + kinds[: window % 3]:
                    steps = _busy_window(
                        kind,
                        window,
                        step=step,
                        writer=writer,
                        state=state,
                        folder=folder,
                        view=view,
                        child=child,
                        blocked=blocked,
                        in_flight=in_flight,
                    )
                    for value in steps:
                        busy[kind].add(value)
                    for _ in range(max(len(steps), 5)):
                        idle.add(step())
                    # Outputs are removed after the idle steps, so deleting them (and the
                    # disk's discards) lands in neither kind of window.
                    (folder / "thread.bin").unlink(missing_ok=True)
                    (folder / "process.bin").unlink(missing_ok=True)
                    shutil.rmtree(folder / "ckpt" / f"{window:012d}", ignore_errors=True)
    finally:
        child.close()
        view.release()
        shm.close()
        shm.unlink()
    slowdown = {kind: busy[kind].median / idle.median - 1.0 for kind in kinds}
    cfg.log(
        f"[training] step {idle.median * 1e3:.1f} ms idle; during a checkpointd save"
        f" {busy['checkpointd'].median * 1e3:.1f} ms ({len(busy['checkpointd'].values)} steps in"
        f" {windows} saves): slowdown {slowdown['checkpointd'] * 100:+.1f}%"
        f" {'ok' if slowdown['checkpointd'] <= 0.10 else 'MISSED (goal <= 10%)'};"
        f" save blocked {blocked.median:.3f} s, in flight {in_flight.median:.3f} s\n"
        f"  same bytes written+fsynced by a bare thread: {slowdown['thread write'] * 100:+.1f}%,"
        f" by a child process from shared memory: {slowdown['process write'] * 100:+.1f}%"
    )
    return {
        "step_idle": idle.summary(),
        "step_during_save": busy["checkpointd"].summary(),
        "step_during_thread_write": busy["thread write"].summary(),
        "step_during_process_write": busy["process write"].summary(),
        "blocked": blocked.summary(),
        "in_flight": in_flight.summary(),
        "slowdown": slowdown["checkpointd"],
        "slowdown_by_writer": slowdown,
        "state_bytes": nbytes,
    }


# ---------------------------------------------------------------------------
# 4. S3 (moto server)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """moto's S3 server in a child process (so it does not share our GIL); yields its URL."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("moto server did not start")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _s3fs(url: str) -> Any:
    import s3fs

    return s3fs.S3FileSystem(
        key="testing",
        secret="testing",
        client_kwargs={"endpoint_url": url, "region_name": "us-east-1"},
        skip_instance_cache=True,
    )


def _create_bucket(url: str, name: str) -> None:
    import boto3

    boto3.client(
        "s3",
        endpoint_url=url,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket=name)


def s3(cfg: Config) -> dict[str, Any]:
    """Throughput to moto: checkpointd saves vs single and parallel s3fs uploads of the same bytes."""
    nbytes = 4 * MiB if cfg.smoke else (64 if cfg.quick else 256) * MiB
    reps = 1 if cfg.smoke else 2
    parallel = (1, 2, 4) if cfg.smoke else (1, 2, 4, 8)
    table = Table()
    cfg.log(f"[s3] {nbytes / MiB:.0f} MiB to a moto server, {reps} reps")
    with moto_server() as url:
        fs = _s3fs(url)
        _create_bucket(url, "bench")
        options = {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": url, "region_name": "us-east-1"},
            "skip_instance_cache": True,
        }
        one = {"model": flat_state(nbytes)}
        split = {f"part{i}": flat_state(nbytes // 4) for i in range(4)}
        payload = b"".join(bytes(t.numpy().data) for t in one["model"].values())
        writers = {
            "checkpointd 1 file": (
                checkpointd.CheckpointWriter("s3://bench/one", storage_options=options),
                one,
            ),
            "checkpointd 4 files": (
                checkpointd.CheckpointWriter("s3://bench/four", storage_options=options),
                split,
            ),
        }
        try:
            step = 0
            for rep in range(reps):
                for name, (writer, state) in writers.items():
                    step += 1
                    start = time.perf_counter()
                    writer.save(step, state).result()
                    table.add(name, time.perf_counter() - start)
                start = time.perf_counter()
                fs.pipe_file(f"bench/single-{rep}", payload)
                table.add("s3fs single PUT", time.perf_counter() - start)
                start = time.perf_counter()
                with fs.open(f"bench/multi-{rep}", "wb", block_size=16 * MiB) as f:
                    f.write(payload)
                table.add("s3fs multipart 16 MiB", time.perf_counter() - start)
                for n in parallel:
                    table.add(f"{n} parallel PUTs", _parallel_puts(fs, payload, n, rep))
                # moto keeps objects in memory: drop this rep's before the next.
                fs.invalidate_cache()
                fs.rm(fs.find("bench"))
        finally:
            for writer, _ in writers.values():
                writer.close()
    throughput = {name: nbytes / s.median / MiB for name, s in table.series.items()}
    for name, series in table.series.items():
        cfg.log(f"  {name:<24} {fmt_seconds(series)}  {throughput[name]:7.1f} MiB/s")
    return {"nbytes": nbytes, "series": table.as_json(), "mib_per_s": throughput}


def _parallel_puts(fs: Any, payload: bytes, n: int, rep: int) -> float:
    size = len(payload) // n
    parts = [payload[i * size : (i + 1) * size if i < n - 1 else len(payload)] for i in range(n)]
    threads = [
        threading.Thread(target=fs.pipe_file, args=(f"bench/par{n}-{rep}-{i}", part))
        for i, part in enumerate(parts)
    ]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


# ---------------------------------------------------------------------------
# 5. Scaling


def scaling(cfg: Config) -> dict[str, Any]:
    """Blocked and durable times from 10 MB up to ``max_bytes``, with the floors at each size."""
    if cfg.smoke:
        sizes = [1 * MiB, 4 * MiB]
    else:
        sizes = [10 * 10**6, 100 * 10**6, 500 * 10**6, 1 * GB, 2 * GB, 4 * GB]
        sizes = [s for s in sizes if s <= cfg.max_bytes]
        if cfg.quick:
            sizes = [s for s in sizes if s <= 1 * GB]
    rows: list[dict[str, Any]] = []
    for nbytes in sizes:
        reps = 1 if cfg.smoke or nbytes >= 2 * GB else 2
        state = {"model": flat_state(nbytes)}
        sources = tensors_of(state)
        targets = [torch.empty_like(t) for t in sources]
        memcpy_floor(sources, targets)
        table = Table()
        with work_dir(cfg.folder, "scaling") as folder:
            ours = Checkpointd(state, folder)
            try:
                for rep in range(reps):
                    table.add("memcpy", memcpy_floor(sources, targets))
                    table.add("raw", raw_write_fsync(folder / "raw.bin", sources))
                    (folder / "raw.bin").unlink()
                    timing = ours.save(rep)
                    table.add("blocked", timing.blocked)
                    table.add("durable", timing.durable)
                    ours.clear()
            finally:
                ours.close()
        del state, sources, targets
        row = {"nbytes": nbytes, "series": table.as_json()}
        rows.append(row)
        cfg.log(
            f"[scaling] {nbytes / GB:7.3f} GB: blocked {table['blocked'].median:.3f} s"
            f" (memcpy {table['memcpy'].median:.3f}), durable {table['durable'].median:.3f} s"
            f" (raw {table['raw'].median:.3f}),"
            f" {nbytes / table['durable'].median / GB:.2f} GB/s durable"
        )
    return {"rows": rows}


# ---------------------------------------------------------------------------
# 6. Peer replicas of the memory tier


def peers(cfg: Config) -> dict[str, Any]:
    """4 services and 4 gloo ranks (FSDP2): a lost node's restore from a peer's memory
    against storage, and replicas=1 against 0 for saves (benchmarks/bench_peers.py)."""
    from benchmarks import bench_peers

    mb, reps = (2.0, 1) if cfg.smoke else (32.0, 2) if cfg.quick else (96.0, 3)
    with work_dir(cfg.folder, "peers") as folder:
        results = bench_peers.run(folder, mb, reps, s3=not cfg.smoke)
    for label, result in results.items():
        cfg.log("\n".join(bench_peers.report(label, result)))
    return results


SECTIONS: dict[str, Callable[[Config], dict[str, Any]]] = {
    "large": large,
    "small": small,
    "training": training,
    "s3": s3,
    "scaling": scaling,
    "stall": stall,
    "load": load,
    "window": window,
    "peers": peers,
}

__all__ = ["SECTIONS", "Config"]
