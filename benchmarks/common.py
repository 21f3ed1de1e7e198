"""What every benchmark shares: model states, the physical floors, the peers, statistics.

Every timing helper returns seconds measured with ``time.perf_counter`` and
leaves its output on disk for the caller to load or remove. Nothing here is a
test: the ratios depend on the machine and its load at the time.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from checkpointd.state.tree import flatten, walk

MiB = 2**20
GB = 10**9
REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------
# States


class Block(torch.nn.Module):
    """One transformer block's weights: attention qkv + projection, a 4x MLP, two norms."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)


def transformer(layers: int = 12, d: int = 1024, seed: int = 0) -> torch.nn.Module:
    """A 12-layer, d=1024 transformer's float32 weights (~151M parameters, ~604 MB)."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = torch.nn.Sequential(*(Block(d) for _ in range(layers)))
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return model


def with_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """An AdamW optimizer over ``model`` with its state filled (one step taken): 3x the bytes."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p in model.parameters():
        p.grad = None
    return optimizer


def flat_state(nbytes: int, tensor_bytes: int = 16 * MiB) -> dict[str, torch.Tensor]:
    """Float32 tensors of ``tensor_bytes`` each (the last one smaller) adding up to ``nbytes``."""
    tensors: dict[str, torch.Tensor] = {}
    left, i = nbytes, 0
    while left > 0:
        n = min(left, tensor_bytes) // 4 or 1
        tensors[f"t{i:05d}"] = torch.randn(n)
        left -= n * 4
        i += 1
    return tensors


def small_tensors(count: int = 20_000, seed: int = 0) -> dict[str, torch.Tensor]:
    """``count`` float32 tensors of 1-64 KB each (an optimizer over many small parameters)."""
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(256, 16 * 1024 + 1, (count,), generator=generator)
    return {f"p{i:05d}": torch.randn(int(n), generator=generator) for i, n in enumerate(sizes)}


def tensors_of(value: Any) -> list[torch.Tensor]:
    """Every tensor in a state (modules and optimizers through their state_dict)."""
    if hasattr(value, "state_dict"):
        value = value.state_dict()
    return [
        leaf
        for _, leaf in walk(plain_state(value) if isinstance(value, Mapping) else value)
        if isinstance(leaf, torch.Tensor)
    ]


def plain_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with modules and optimizers replaced by their state dicts (for the peers)."""
    return {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in state.items()}


def nbytes_of(state: Mapping[str, Any]) -> int:
    """Bytes of tensor data in ``state``, counting shared storage once."""
    seen: dict[tuple[int, int], int] = {}
    for t in tensors_of(dict(state)):
        seen[(t.untyped_storage().data_ptr(), t.storage_offset())] = t.numel() * t.element_size()
    return sum(seen.values())


# ---------------------------------------------------------------------------
# Floors and peers


def memcpy_floor(sources: list[torch.Tensor], targets: list[torch.Tensor]) -> float:
    """Copy every source into its preallocated target (already touched once)."""
    start = time.perf_counter()
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source)
    return time.perf_counter() - start


def fsync_path(path: Path) -> None:
    """fsync a file or folder by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_write_fsync(path: Path, sources: list[torch.Tensor], chunk: int = 64 * MiB) -> float:
    """One file, the tensors' bytes written sequentially with os.write, then fsync."""
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for tensor in sources:
            view = memoryview(tensor.detach().contiguous().numpy()).cast("B")
            for offset in range(0, len(view), chunk):
                part = view[offset : offset + chunk]
                while part:
                    part = part[os.write(fd, part) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def torch_save_fsync(path: Path, state: Any) -> float:
    """torch.save into an open file, flush, fsync."""
    start = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start


def safetensors_save_fsync(path: Path, tensors: dict[str, torch.Tensor]) -> float:
    """safetensors.torch.save_file, then fsync the file."""
    import safetensors.torch

    start = time.perf_counter()
    safetensors.torch.save_file(tensors, str(path))
    fsync_path(path)
    return time.perf_counter() - start


def flat_tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A flat name -> tensor dict of a (nested) state, tied tensors once (safetensors needs it)."""
    tensors, _ = flatten(plain_state(state), unique=True)
    return {name: tensor.contiguous() for name, tensor in tensors.items()}


def drop_cache(path: Path) -> None:
    """Evict ``path``'s (clean) pages from the page cache; only this file, not the machine's."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def remove(path: Path) -> None:
    """Remove a file or folder if present."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------
# Statistics and reporting


@dataclass
class Series:
    """Repeated measurements of one quantity (seconds, or bytes for memory)."""

    values: list[float] = field(default_factory=list)

    def add(self, value: float) -> None:
        self.values.append(value)

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else math.nan

    def summary(self) -> dict[str, Any]:
        """Median, min, max and every value, for the JSON results."""
        if not self.values:
            return {"median": None, "min": None, "max": None, "values": []}
        return {
            "median": self.median,
            "min": min(self.values),
            "max": max(self.values),
            "values": list(self.values),
        }


class Table:
    """Named series of one benchmark, filled rep by rep; prints medians, spread and ratios."""

    def __init__(self) -> None:
        self.series: dict[str, Series] = {}

    def add(self, name: str, value: float) -> None:
        self.series.setdefault(name, Series()).add(value)

    def __getitem__(self, name: str) -> Series:
        return self.series[name]

    def ratio(self, numerator: str, denominator: str) -> float:
        """Ratio of medians."""
        return self[numerator].median / self[denominator].median

    def as_json(self) -> dict[str, Any]:
        return {name: s.summary() for name, s in self.series.items()}


def fmt_seconds(series: Series) -> str:
    values = series.values
    if not values:
        return "n/a"
    return f"{series.median:7.3f} s  [{min(values):.3f}..{max(values):.3f}]"


def free_space(folder: Path) -> int:
    """Bytes available to us in ``folder``'s file system."""
    return shutil.disk_usage(folder).free


def pick_folder(requested: str | None, needed: int) -> Path:
    """The folder to write into: ``requested``, else /tmp; refuse if it lacks ``needed`` bytes."""
    folder = Path(requested or os.environ.get("CHECKPOINTD_BENCH_DIR", "/tmp")).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    if free_space(folder) < needed:
        raise SystemExit(
            f"{folder} has {free_space(folder) / GB:.1f} GB free; {needed / GB:.1f} GB needed"
        )
    return folder


@contextlib.contextmanager
def work_dir(parent: Path, name: str) -> Iterator[Path]:
    """A fresh folder under ``parent``, removed afterwards."""
    folder = parent / f"checkpointd-bench-{name}-{os.getpid()}"
    remove(folder)
    folder.mkdir(parents=True)
    try:
        yield folder
    finally:
        remove(folder)


def machine(folder: Path) -> dict[str, Any]:
    """A description of the machine and its load, for the results."""
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "loadavg": os.getloadavg(),
        "folder": str(folder),
    }
    with contextlib.suppress(OSError, ValueError):
        meminfo = dict(
            line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines()
        )
        info["mem_total_gib"] = round(int(meminfo["MemTotal"].split()[0]) / 2**20, 1)
        info["mem_available_gib"] = round(int(meminfo["MemAvailable"].split()[0]) / 2**20, 1)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["df", "-T", str(folder)], capture_output=True, text=True, check=True, timeout=10
        ).stdout.splitlines()[-1]
        info["filesystem"] = " ".join(out.split()[:2])
    with contextlib.suppress(OSError, IndexError):
        cpu = [
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ]
        info["cpu"] = cpu[0].split(":", 1)[1].strip()
    return info


def describe(info: Mapping[str, Any]) -> str:
    """One line for humans."""
    return (
        f"{info.get('cpus')} CPUs ({info.get('cpu', '?')}), "
        f"{info.get('mem_total_gib', '?')} GiB RAM ({info.get('mem_available_gib', '?')} free), "
        f"{info.get('filesystem', '?')} at {info.get('folder')}, torch {info.get('torch')}, "
        f"load average {', '.join(f'{x:.2f}' for x in info.get('loadavg', ()))}"
    )


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` took."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def repo_env(src: str | Path = REPO / "src") -> dict[str, str]:
    """This process's environment with ``src`` (this checkout's by default, or another
    worktree's for a before/after run) and the repository on PYTHONPATH: what a child
    process (a rank, a trainer, a service) is started with."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(REPO)])}


_STARTERS: list[Callable[..., subprocess.Popen[Any]]] = []


def _this_checkout(env: Mapping[str, str] | None) -> bool:
    """Whether a child with ``env`` imports checkpointd from this checkout's src."""
    for entry in (os.environ if env is None else env).get("PYTHONPATH", "").split(os.pathsep):
        if entry and Path(entry, "checkpointd", "__init__.py").is_file():
            return Path(entry).resolve() == REPO / "src"
    import checkpointd

    return Path(checkpointd.__file__).resolve().parents[1] == REPO / "src"


def spawn(command: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(command, **kwargs)`` for a ``python -m`` child of this checkout (a
    service, a rank, a trainer, a fresh process timing a load), or inside ``starting_with``
    the Popen given there; never that for a child of another tree's src (a --before row)."""
    if _STARTERS and _this_checkout(kwargs.get("env")):
        return _STARTERS[-1](command, **kwargs)
    return subprocess.Popen(command, **kwargs)


def spawn_output(command: list[str], env: Mapping[str, str], timeout: float = 600) -> str:
    """The standard output of ``spawn(command, env=env)``, which must exit 0 within
    ``timeout`` seconds (CalledProcessError with its standard error otherwise)."""
    with spawn(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, command, out, err)
    return str(out)


@contextlib.contextmanager
def starting_with(popen: Callable[..., subprocess.Popen[Any]]) -> Iterator[None]:
    """Within: ``spawn`` starts its children with ``popen``. The test suite's smokes pass
    their zygote's (tests/support/zygote.py), which forks a ``python -m`` child from a
    process that has imported torch and checkpointd (~2 s of CPU a child, on a suite bound
    by its 2 cores); what a child times begins after its imports either way."""
    _STARTERS.append(popen)
    try:
        yield
    finally:
        _STARTERS.remove(popen)


def start_service(
    folder: str, *args: str, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """``checkpointd serve --socket FOLDER/sock ARGS`` (its output in ``FOLDER/serve.log``,
    ``env`` by default ``repo_env()``), returned once it accepts a connection;
    ServiceError if it exits or does not answer within 60 s."""
    from checkpointd.daemon.client.client import Connection
    from checkpointd.errors import ServiceError

    socket = os.path.join(folder, "sock")
    with open(os.path.join(folder, "serve.log"), "ab") as log:
        proc = spawn(
            [sys.executable, "-m", "checkpointd", "serve", "--socket", socket, *args],
            env=dict(repo_env() if env is None else env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
    deadline = time.monotonic() + 60
    while True:
        try:
            Connection(socket).close()
            return proc
        except ServiceError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
