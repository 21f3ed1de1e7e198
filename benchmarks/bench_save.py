"""Save and load of one large state: checkpointd against the physical floors and its peers.

In one run, on the same state, interleaving the contenders in every repetition
(so a noisy neighbour hits them all alike), it prints:

- caller-blocked time of ``CheckpointWriter.save`` (second save on) over the
  memcpy floor (copying the same tensors into preallocated buffers);
- time until durable over a raw sequential write+fsync of the same bytes, and
  over ``torch.save``+fsync (and, with ``--peers all``, safetensors and DCP);
- load time over ``torch.load`` (page cache warm, and cold: each file's pages
  evicted with posix_fadvise, which touches no other file).

Run: ``python -m benchmarks.bench_save [--reps 5] [--dir /tmp]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import checkpointd
from benchmarks.common import (
    GB,
    Table,
    describe,
    drop_cache,
    flat_tensors,
    fmt_seconds,
    machine,
    memcpy_floor,
    nbytes_of,
    pick_folder,
    plain_state,
    raw_write_fsync,
    remove,
    safetensors_save_fsync,
    tensors_of,
    torch_save_fsync,
    transformer,
    with_adamw,
    work_dir,
)

PEERS_CORE = ("torch.save",)
PEERS_ALL = ("torch.save", "safetensors", "dcp", "dcp_async")


@dataclass
class SaveTiming:
    blocked: float
    durable: float


class Contender:
    """One way of saving and loading ``state`` under ``folder``; ``save`` leaves its output."""

    name = ""

    def __init__(self, state: Mapping[str, Any], folder: Path) -> None:
        self.state = state
        self.folder = folder
        self.path = folder / self.name.replace(".", "_")

    def save(self, rep: int) -> SaveTiming:
        raise NotImplementedError

    def load(self) -> float:
        raise NotImplementedError

    def clear(self) -> None:
        """Remove the output of the last save."""
        remove(self.path)

    def close(self) -> None:
        self.clear()


class Checkpointd(Contender):
    name = "checkpointd"

    def __init__(self, state: Mapping[str, Any], folder: Path) -> None:
        super().__init__(state, folder)
        self.writer = checkpointd.CheckpointWriter(str(self.path))
        self.step = 0
        # The first save allocates the staging buffer; every timed save reuses it.
        self.writer.save(self.step, state).result()
        self.clear()

    def save(self, rep: int) -> SaveTiming:
        self.step += 1
        start = time.perf_counter()
        handle = self.writer.save(self.step, self.state)
        blocked = time.perf_counter() - start
        handle.result()
        return SaveTiming(blocked, time.perf_counter() - start)

    def load(self) -> float:
        start = time.perf_counter()
        checkpointd.load(str(self.path), self.step)
        return time.perf_counter() - start

    def clear(self) -> None:
        if self.path.is_dir():
            for child in self.path.iterdir():
                if child.is_dir():
                    remove(child)

    def close(self) -> None:
        self.writer.close()
        remove(self.path)


class TorchSave(Contender):
    name = "torch.save"

    def __init__(self, state: Mapping[str, Any], folder: Path) -> None:
        super().__init__(state, folder)
        self.plain = plain_state(state)

    def save(self, rep: int) -> SaveTiming:
        seconds = torch_save_fsync(self.path, self.plain)
        return SaveTiming(seconds, seconds)

    def load(self) -> float:
        start = time.perf_counter()
        torch.load(self.path, weights_only=True)
        return time.perf_counter() - start


class Safetensors(Contender):
    name = "safetensors"

    def __init__(self, state: Mapping[str, Any], folder: Path) -> None:
        super().__init__(state, folder)
        self.tensors = flat_tensors(state)

    def save(self, rep: int) -> SaveTiming:
        seconds = safetensors_save_fsync(self.path, self.tensors)
        return SaveTiming(seconds, seconds)

    def load(self) -> float:
        import safetensors.torch

        start = time.perf_counter()
        safetensors.torch.load_file(str(self.path))
        return time.perf_counter() - start


@contextlib.contextmanager
def process_group(folder: Path) -> Iterator[None]:
    """A gloo process group of world size 1 (DCP's setting for one process)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    store = dist.FileStore(str(folder / "pg-store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Dcp(Contender):
    """torch.distributed.checkpoint.save (FileSystemWriter fsyncs its files)."""

    name = "dcp"

    def __init__(self, state: Mapping[str, Any], folder: Path) -> None:
        super().__init__(state, folder)
        self.plain = plain_state(state)

    def save(self, rep: int) -> SaveTiming:
        import torch.distributed.checkpoint as dcp

        start = time.perf_counter()
        dcp.save(self.plain, checkpoint_id=str(self.path))
        seconds = time.perf_counter() - start
        return SaveTiming(seconds, seconds)

    def load(self) -> float:
        import torch.distributed.checkpoint as dcp

        target = {k: _empty_like(v) for k, v in self.plain.items()}
        start = time.perf_counter()
        dcp.load(target, checkpoint_id=str(self.path))
        return time.perf_counter() - start


class DcpAsync(Dcp):
    """torch.distributed.checkpoint.async_save: blocked until it returns, durable at result()."""

    name = "dcp_async"

    def save(self, rep: int) -> SaveTiming:
        import torch.distributed.checkpoint as dcp

        start = time.perf_counter()
        future = dcp.async_save(self.plain, checkpoint_id=str(self.path))
        blocked = time.perf_counter() - start
        future.result()
        return SaveTiming(blocked, time.perf_counter() - start)


def _empty_like(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value)
    if isinstance(value, Mapping):
        return {k: _empty_like(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_empty_like(v) for v in value]
    return value


CONTENDERS: dict[str, Callable[[Mapping[str, Any], Path], Contender]] = {
    "checkpointd": Checkpointd,
    "torch.save": TorchSave,
    "safetensors": Safetensors,
    "dcp": Dcp,
    "dcp_async": DcpAsync,
}


def compare(
    state: Mapping[str, Any],
    folder: Path,
    *,
    reps: int,
    peers: tuple[str, ...] = PEERS_CORE,
    load_reps: int | None = None,
    log: Callable[[str], None] = print,
) -> Table:
    """Measure every contender on ``state``, interleaved per repetition; return the series.

    Series: ``memcpy``, ``raw``, ``{name}.blocked``, ``{name}.durable``,
    ``{name}.load_warm``, ``{name}.load_cold``.
    """
    table = Table()
    sources = tensors_of(dict(state))
    targets = [torch.empty_like(t) for t in sources]
    memcpy_floor(sources, targets)  # touch the targets once
    raw_path = folder / "raw.bin"
    with contextlib.ExitStack() as stack:
        if any(p.startswith("dcp") for p in peers):
            stack.enter_context(process_group(folder))
        contenders = [CONTENDERS["checkpointd"](state, folder)]
        stack.callback(lambda: [c.close() for c in contenders])
        contenders += [CONTENDERS[p](state, folder) for p in peers]
        for rep in range(reps):
            # Rotate the order so no contender always runs right after the same one.
            shift = rep % (len(contenders) + 2)
            jobs: list[Callable[[], None]] = [
                lambda: table.add("memcpy", memcpy_floor(sources, targets)),
                lambda: _raw(table, raw_path, sources),
                *(_saver(table, c, rep) for c in contenders),
            ]
            for job in jobs[shift:] + jobs[:shift]:
                job()
            log(f"  save rep {rep + 1}/{reps} done")
        # Keep the last output of each contender for loading.
        for contender in contenders:
            contender.save(reps)
        # DCP's async_save writes the same files as its save: loaded once, as "dcp".
        loaders = [c for c in contenders if c.name != "dcp_async"]
        for contender in loaders:
            contender.load()  # warm: the file is in the page cache for the timed loads
        for rep in range(load_reps or reps):
            for contender in loaders[rep % len(loaders) :] + loaders[: rep % len(loaders)]:
                table.add(f"{contender.name}.load_warm", contender.load())
            for contender in loaders:
                drop_cache(contender.path)
                table.add(f"{contender.name}.load_cold", contender.load())
        log("  load reps done")
    return table


def _raw(table: Table, path: Path, sources: list[torch.Tensor]) -> None:
    table.add("raw", raw_write_fsync(path, sources))
    path.unlink()


def _saver(table: Table, contender: Contender, rep: int) -> Callable[[], None]:
    def job() -> None:
        timing = contender.save(rep)
        table.add(f"{contender.name}.blocked", timing.blocked)
        table.add(f"{contender.name}.durable", timing.durable)
        contender.clear()

    return job


def report(table: Table, nbytes: int, peers: tuple[str, ...]) -> list[str]:
    """Human-readable lines: medians with [min..max] and the ratios the goals are about."""
    lines = [
        f"state: {nbytes / GB:.3f} GB; median [min..max] over {len(table['memcpy'].values)} reps"
    ]
    lines.append(f"  memcpy floor              {fmt_seconds(table['memcpy'])}")
    lines.append(f"  raw write+fsync           {fmt_seconds(table['raw'])}")
    for name in ("checkpointd", *peers):
        lines.append(f"  {name + ' blocked':<25} {fmt_seconds(table[name + '.blocked'])}")
        lines.append(f"  {name + ' durable':<25} {fmt_seconds(table[name + '.durable'])}")
    for name in ("checkpointd", *peers):
        if f"{name}.load_warm" in table.series:
            lines.append(f"  {name + ' load (warm)':<25} {fmt_seconds(table[name + '.load_warm'])}")
            lines.append(f"  {name + ' load (cold)':<25} {fmt_seconds(table[name + '.load_cold'])}")
    lines.append("ratios (of medians):")
    for label, value, goal in ratios(table, peers):
        mark = "" if goal is None else ("  ok" if value <= goal else f"  MISSED (goal <= {goal})")
        lines.append(f"  {label:<45} {value:6.2f}x{mark}")
    return lines


def ratios(table: Table, peers: tuple[str, ...]) -> list[tuple[str, float, float | None]]:
    """(label, ratio of medians, goal or None) for the figures the issues set goals on."""
    out: list[tuple[str, float, float | None]] = [
        ("checkpointd blocked / memcpy floor", table.ratio("checkpointd.blocked", "memcpy"), 1.5),
        ("checkpointd durable / raw write+fsync", table.ratio("checkpointd.durable", "raw"), 1.25),
    ]
    for peer in peers:
        goal = 0.8 if peer == "torch.save" else None
        out.append(
            (
                f"checkpointd durable / {peer} durable",
                table.ratio("checkpointd.durable", f"{peer}.durable"),
                goal,
            )
        )
    if "dcp_async" in peers:
        out.append(
            (
                "checkpointd blocked / dcp_async blocked",
                table.ratio("checkpointd.blocked", "dcp_async.blocked"),
                0.5,
            )
        )
    for kind in ("warm", "cold"):
        if "torch.save.load_warm" in table.series:
            out.append(
                (
                    f"checkpointd load / torch.load ({kind})",
                    table.ratio(f"checkpointd.load_{kind}", f"torch.save.load_{kind}"),
                    1.0,
                )
            )
    return out


def model_state(with_optimizer: bool, *, layers: int = 12, d: int = 1024) -> dict[str, Any]:
    """The 12-layer d=1024 model (~604 MB), plus its AdamW state (~1.8 GB in all) if asked."""
    model = transformer(layers, d)
    state: dict[str, Any] = {"model": model}
    if with_optimizer:
        state["optimizer"] = with_adamw(model)
    return state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="repetitions (default 5)")
    parser.add_argument("--dir", help="folder to write in (default $CHECKPOINTD_BENCH_DIR or /tmp)")
    parser.add_argument("--optimizer", action="store_true", help="add AdamW state (~1.8 GB)")
    parser.add_argument(
        "--peers",
        choices=("core", "all"),
        default="core",
        help="core: torch.save; all: also safetensors, DCP save and async_save",
    )
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    peers = PEERS_ALL if args.peers == "all" else PEERS_CORE
    state = model_state(args.optimizer)
    nbytes = nbytes_of(state)
    parent = pick_folder(args.dir, nbytes * (len(peers) + 3))
    info = machine(parent)
    print(f"machine: {describe(info)}")
    with work_dir(parent, "save") as folder:
        table = compare(state, folder, reps=args.reps, peers=peers)
    info["loadavg_after"] = os.getloadavg()
    print("\n".join(report(table, nbytes, peers)))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"machine": info, "nbytes": nbytes, "series": table.as_json()}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
