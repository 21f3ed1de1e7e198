"""Restore and load of one large model: checkpointd against torch.load, side by side.

One run, one model (by default ~705 MB: 12 blocks of 4 float32 ``Linear(d, d)``),
both files in the page cache, the contenders interleaved (rotated) in every
repetition; it prints medians with [min..max] and the ratios the goals are on:

- ``load``: ``torch.load(p, weights_only=True)`` vs ``checkpointd.load(root)``;
- ``restore`` warm: ``model.load_state_dict(torch.load(p))`` vs
  ``checkpointd.restore(root, {"model": model})`` into the same live model;
- the same in a fresh process (what a resume after a crash does): a child
  process builds the model (its memory touched, as a constructor's init does),
  then times only the restore, and reports its peak extra RSS during it;
- ``load`` in a fresh process too (a warm process's ``torch.load`` may get its
  tensors' memory back from glibc's heap, already faulted in, where a fresh process
  faults every page: the warm ``torch.load`` is bimodal, 0.03 s or 0.16 s for 290 MB);
- ``load`` in a long-lived process: a child that saves 3 steps with a writer (as a
  trainer does), then alternates ``torch.load`` and ``checkpointd.load`` without a
  ``gc.collect()`` between (issue 35: each load faulted its whole size in again);
- the memcpy floor: the same bytes copied into tensors already touched;
- with ``--before SRC``: ``checkpointd.load`` in a fresh process run from another
  source tree too (a worktree of an older commit), in the same rotation as the other
  fresh rows, for a before/after comparison in one run;
- with ``--ranks-mb``: FSDP2 + AdamW on 2 and 4 ranks, and 3 ranks restoring what 2
  saved, ``checkpointd.restore`` vs ``dcp.load`` + ``set_state_dict`` (bench_ranks);
- with ``--s3-mb``: restore from S3 (moto) vs s3fs reading the same objects in turn,
  and a small checkpoint's restore (restore_s3.py).

Run: ``python -m benchmarks.bench_restore [--mb 705] [--reps 5] [--dir /tmp]
[--ranks-mb 64] [--s3-mb 256] [--before SRC]`` (``--smoke``: a tiny model, 2 reps). Writes
``benchmarks/results/restore.json`` (or ``--json``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import checkpointd
from benchmarks.common import (
    GB,
    Table,
    describe,
    fmt_seconds,
    machine,
    memcpy_floor,
    pick_folder,
    spawn_output,
    work_dir,
)

BLOCKS, LINEARS = 12, 4
RESULTS = Path(__file__).parent / "results" / "restore.json"


def width_for(mb: float) -> int:
    """The ``d`` of ``BLOCKS * LINEARS`` float32 ``Linear(d, d)`` adding up to ``mb`` MB."""
    layers = BLOCKS * LINEARS
    # layers * (d*d + d) * 4 bytes = mb * 1e6
    d = (-1 + math.sqrt(1 + 4 * mb * 1e6 / (4 * layers))) / 2
    return max(1, round(d))


def build(d: int, seed: int | None = 0) -> torch.nn.Module:
    """The model: weights random (``seed``) or zeros (``None``), every page touched."""
    with torch.device("meta"):
        model = torch.nn.Sequential(
            *(
                torch.nn.Sequential(*(torch.nn.Linear(d, d) for _ in range(LINEARS)))
                for _ in range(BLOCKS)
            )
        )
    model = model.to_empty(device="cpu")
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if generator is None:
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=generator)
    return model


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    """Make VmHWM (peak RSS) equal the current RSS (Linux >= 4.0); no-op elsewhere."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _torch_restore(model: torch.nn.Module, path: Path) -> None:
    model.load_state_dict(torch.load(path, weights_only=True))


def _checkpointd_restore(model: torch.nn.Module, root: Path) -> None:
    checkpointd.restore(str(root), {"model": model})


def long_lived(folder: Path, d: int, reps: int) -> dict[str, Any]:
    """In a fresh process that lives on: save 3 steps with a writer, then ``reps`` rounds
    of ``torch.load`` and ``checkpointd.load`` (order alternating, no gc between); the
    seconds of each and the process's peak RSS."""
    model, root = build(d), folder / "long-lived"
    with checkpointd.CheckpointWriter(str(root), keep_last=1) as writer:
        for step in range(3):
            writer.save(step, {"model": model}).result()
        loaders: list[tuple[str, Callable[[], Any]]] = [
            ("torch.load", lambda: torch.load(folder / "model.pt", weights_only=True)),
            ("checkpointd.load", lambda: checkpointd.load(str(root))),
        ]
        out: dict[str, Any] = {name: [] for name, _ in loaders}
        for rep in range(reps):
            for name, load in loaders[rep % 2 :] + loaders[: rep % 2]:
                out[name].append(_timed(load))
    return {**out, "peak_rss": float(_status("VmHWM"))}


def child(kind: str, where: Path, d: int) -> dict[str, Any]:
    """In a fresh process: build the model (for a restore), then time one restore or
    load (kind ``torch``, ``checkpointd``, ``torch.load``, ``checkpointd.load``) and its
    peak extra RSS; or (kind ``long-lived:REPS``) ``long_lived`` in folder ``where``."""
    if kind.startswith("long-lived:"):
        return long_lived(where, d, int(kind.partition(":")[2]))
    model = build(d, seed=None) if not kind.endswith(".load") else None
    gc.collect()
    _reset_peak()
    before = _status("VmRSS")
    loaded: Any = None  # kept until timed: freeing it is not part of a load
    start = time.perf_counter()
    if kind == "torch.load":
        loaded = torch.load(where, weights_only=True)
    elif kind == "checkpointd.load":
        loaded = checkpointd.load(str(where))
    elif kind == "torch":
        assert model is not None
        _torch_restore(model, where)
    else:
        assert model is not None
        _checkpointd_restore(model, where)
    seconds = time.perf_counter() - start
    del loaded
    peak = _status("VmHWM")
    return {"seconds": seconds, "extra_rss": float(max(0, peak - before))}


def _fresh(kind: str, where: Path, d: int, src: str | None = None) -> dict[str, Any]:
    """``child(kind, where, d)`` in a fresh process (``spawn``'s): checkpointd from this
    process's path, or from source tree ``src`` (then this repository's benchmarks behind
    it; a new interpreter always, which imports that tree's code)."""
    path = sys.path if src is None else [src, str(Path(__file__).resolve().parents[1])]
    command = [sys.executable, "-m", "benchmarks.bench_restore", "--child", kind, str(where)]
    command.append(str(d))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    if src is None:
        out = spawn_output(command, env)
    else:
        out = subprocess.run(
            command, capture_output=True, text=True, check=True, timeout=600, env=env
        ).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def compare(
    d: int,
    folder: Path,
    *,
    reps: int,
    fresh_reps: int,
    before: str | None = None,
    log: Callable[[str], None] = print,
) -> tuple[Table, int]:
    """Every row, interleaved per repetition; the series and the state's bytes. ``before``:
    a source tree whose ``checkpointd.load`` joins the fresh rows."""
    table = Table()
    path, root = folder / "model.pt", folder / "ckpt"
    nbytes = _in_one_process(table, d, path, root, reps=reps, log=log)
    gc.collect()
    kinds: list[tuple[str, Path, str | None]] = [
        ("torch", path, None),
        ("checkpointd", root, None),
        ("torch.load", path, None),
        ("checkpointd.load", root, None),
    ]
    if before is not None:
        kinds.append(("checkpointd.load", root, before))
    for rep in range(fresh_reps):
        shift = rep % len(kinds)
        for kind, where, src in kinds[shift:] + kinds[:shift]:
            result = _fresh(kind, where, d, src)
            name = kind if src is None else f"{kind}.before"
            table.add(f"{name}.fresh", result["seconds"])
            table.add(f"{name}.fresh_extra_rss", result["extra_rss"])
        log(f"  fresh rep {rep + 1}/{fresh_reps} done")
    lived = _fresh(f"long-lived:{reps}", folder, d)
    for name in ("torch.load", "checkpointd.load"):
        for seconds in lived[name]:
            table.add(f"{name}.long_lived", seconds)
    table.add("long_lived.peak_rss", lived["peak_rss"])
    log("  long-lived process done")
    return table, nbytes


def _in_one_process(
    table: Table, d: int, path: Path, root: Path, *, reps: int, log: Callable[[str], None]
) -> int:
    """Save the model both ways, then the rows measured in this process; its bytes."""
    model = build(d)
    sources = list(model.state_dict().values())
    nbytes = sum(t.numel() * t.element_size() for t in sources)
    torch.save(model.state_dict(), path)
    with checkpointd.CheckpointWriter(str(root)) as writer:
        writer.save(1, {"model": model}).result()
    targets = [torch.empty_like(t) for t in sources]
    memcpy_floor(sources, targets)
    live = build(d, seed=1)
    # Warm the page cache and check both restore what was saved.
    _torch_restore(live, path)
    _checkpointd_restore(live, root)
    assert all(torch.equal(a, b) for a, b in zip(live.state_dict().values(), sources, strict=True))

    def load_torch() -> None:
        table.add("torch.load", _timed(lambda: torch.load(path, weights_only=True)))

    def load_ours() -> None:
        table.add("checkpointd.load", _timed(lambda: checkpointd.load(str(root))))

    def restore_torch() -> None:
        table.add("torch.restore", _timed(lambda: _torch_restore(live, path)))

    def restore_ours() -> None:
        table.add("checkpointd.read.restore", _timed(lambda: _checkpointd_restore(live, root)))

    def memcpy() -> None:
        table.add("memcpy", memcpy_floor(sources, targets))

    jobs = [memcpy, load_torch, load_ours, restore_torch, restore_ours]
    for rep in range(reps):
        shift = rep % len(jobs)
        for job in jobs[shift:] + jobs[:shift]:
            job()
            gc.collect()
        log(f"  rep {rep + 1}/{reps} done")
    return nbytes


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    del result
    return seconds


ROWS = (
    ("load", "checkpointd.load", "torch.load", 0.7),
    ("load, fresh process", "checkpointd.load.fresh", "torch.load.fresh", 0.7),
    ("load, fresh process, --before", "checkpointd.load.before.fresh", "torch.load.fresh", 0.7),
    ("load, long-lived process", "checkpointd.load.long_lived", "torch.load.long_lived", 1.0),
    ("restore, warm", "checkpointd.read.restore", "torch.restore", 0.8),
    ("restore, fresh process", "checkpointd.fresh", "torch.fresh", 0.6),
)


def report(table: Table, nbytes: int) -> list[str]:
    reps = len(table["memcpy"].values)
    lines = [f"model: {nbytes / GB:.3f} GB; median [min..max] over {reps} reps"]
    labels = {
        "memcpy": "memcpy floor",
        "torch.load": "torch.load",
        "checkpointd.load": "checkpointd.load",
        "torch.restore": "load_state_dict(torch.load) warm",
        "checkpointd.read.restore": "checkpointd.restore warm",
        "torch.fresh": "load_state_dict(torch.load) fresh",
        "checkpointd.fresh": "checkpointd.restore fresh",
        "torch.load.fresh": "torch.load fresh",
        "checkpointd.load.fresh": "checkpointd.load fresh",
        "checkpointd.load.before.fresh": "checkpointd.load fresh, --before",
        "torch.load.long_lived": "torch.load long-lived",
        "checkpointd.load.long_lived": "checkpointd.load long-lived",
    }
    for key, label in labels.items():
        if key in table.series:
            lines.append(f"  {label:<36} {fmt_seconds(table[key])}")
    for kind in (
        "torch",
        "checkpointd",
        "torch.load",
        "checkpointd.load",
        "checkpointd.load.before",
    ):
        key = f"{kind}.fresh_extra_rss"
        if key in table.series:
            lines.append(
                f"  {kind + ' peak extra RSS (fresh)':<36} {table[key].median / 2**20:7.1f} MiB"
            )
    if "long_lived.peak_rss" in table.series:
        peak = table["long_lived.peak_rss"].median / 2**20
        lines.append(f"  {'long-lived process peak RSS':<36} {peak:7.1f} MiB")
    lines.append("ratios (of medians):")
    for label, ours, theirs, goal in ROWS:
        if ours in table.series and theirs in table.series:
            value = table.ratio(ours, theirs)
            mark = "ok" if value <= goal else f"MISSED (goal <= {goal})"
            lines.append(f"  {label + ': checkpointd / torch':<45} {value:6.2f}x  {mark}")
    lines.append(
        f"  {'restore warm / memcpy floor':<45} "
        f"{table.ratio('checkpointd.read.restore', 'memcpy'):6.2f}x"
    )
    return lines


def _ranks(mb: float, reps: int, folder: Path) -> dict[str, Any]:
    """bench_ranks' runs of 2 and 4 ranks (and 3 restoring what 2 saved): restore rows."""
    from benchmarks import bench_ranks

    with work_dir(folder, "restore-ranks") as work:
        results: dict[str, Any] = bench_ranks.run([2, 4], mb, reps, work)
    return results


def _ranks_report(results: dict[str, Any]) -> list[str]:
    worlds = results["worlds"]
    lines = [f"many ranks: FSDP2 + AdamW, {results['mb']:g} MB of parameters (slowest rank)"]
    rows = (
        ("2 ranks", worlds["2"]),
        ("4 ranks", worlds["4"]),
        ("2 -> 3 ranks", results["reshard_2_to_3"]),
    )
    for label, s in rows:
        ratio = s["checkpointd.read.restore"] / s["dcp.restore"]
        mark = "ok" if ratio <= 0.8 else "MISSED (goal <= 0.8)"
        lines.append(
            f"  {label}: checkpointd.restore {s['checkpointd.read.restore']:.3f} s, "
            f"dcp.load + set_state_dict {s['dcp.restore']:.3f} s: {ratio:.2f}x  {mark}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=705.0, help="model size in MB (1e6 bytes)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--fresh-reps", type=int, default=None, help="default: --reps")
    parser.add_argument("--dir", default=None, help="where to write (default /tmp)")
    parser.add_argument("--json", default=str(RESULTS), help="where to write the results")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 2 reps")
    parser.add_argument(
        "--ranks-mb",
        type=float,
        default=0,
        help="also the many-rank rows (FSDP2 + AdamW restore vs DCP on 2 and 4 ranks, and "
        "2 -> 3): parameter MB, through benchmarks.bench_ranks (0: skip, the default)",
    )
    parser.add_argument(
        "--s3-mb",
        type=float,
        default=0,
        help="also the S3 rows (restore from moto vs s3fs reading the same objects in "
        "turn): model MB (0: skip, the default; benchmarks/restore_s3.py)",
    )
    parser.add_argument(
        "--before",
        metavar="SRC",
        help="also checkpointd.load in a fresh process run from this source tree (e.g. "
        "a worktree of an older commit's src), interleaved with the other fresh rows",
    )
    parser.add_argument("--child", nargs=3, metavar=("KIND", "PATH", "D"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, where, d = args.child
        print(json.dumps(child(kind, Path(where), int(d))))
        return 0
    if args.smoke:
        args.mb, args.reps, args.fresh_reps = 2.0, 2, 2
    d = width_for(args.mb)
    folder = pick_folder(args.dir, int(args.mb * 1e6 * 2.2))
    info = machine(folder)
    print(describe(info))
    with work_dir(folder, "restore") as work:
        table, nbytes = compare(
            d, work, reps=args.reps, fresh_reps=args.fresh_reps or args.reps, before=args.before
        )
    lines = report(table, nbytes)
    ranks: dict[str, Any] | None = None
    if args.ranks_mb:
        ranks = _ranks(args.ranks_mb, args.reps, folder)
        lines += _ranks_report(ranks)
    s3: dict[str, Any] | None = None
    if args.s3_mb:
        from benchmarks import restore_s3

        s3_table, s3_bytes, s3_objects = restore_s3.run(build, width_for(args.s3_mb), args.reps)
        lines += restore_s3.report(s3_table, s3_bytes, s3_objects)
        s3 = {"nbytes": s3_bytes, "objects": s3_objects, "series": s3_table.as_json()}
    print("\n".join(lines))
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        results = {
            "machine": info,
            "command": "python -m benchmarks.bench_restore " + " ".join(argv or sys.argv[1:]),
            "nbytes": nbytes,
            "d": d,
            "series": table.as_json(),
            "ranks": ranks,
            "s3": s3,
            "ratios": {
                label: table.ratio(ours, theirs)
                for label, ours, theirs, _ in ROWS
                if ours in table.series and theirs in table.series
            },
        }
        out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
