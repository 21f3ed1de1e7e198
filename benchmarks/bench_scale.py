"""Scale model of the many-rank commit: 8 to 16,384 simulated ranks on one real TCPStore.

Run: ``python -m benchmarks.bench_scale`` (the sweep, minutes) or ``--quick`` (3 rank
counts, seconds; ``--unchunked`` posts every store value in one piece, as before;
``--inline`` keeps shard entries in the manifest at any size, as before shard index
files). Per rank count and layout (``scale_layout``: Llama-3-70B with AdamW
state as FSDP2 over every rank, and as HSDP with shards over ``--shard-group`` ranks
replicated over the rest), against a ``torch.distributed.TCPStore`` served by this
process:

- every simulated rank but two posts its digests and its share (``Attempt.post``, the
  bytes ``write.ranked_commit`` posts), from ``--clients`` threads with a store connection each;
- rank 0 (the publisher) and the last rank (a follower) run the real
  ``write.ranked_commit.commit_ranked`` on a local folder (their files are a few bytes each:
  the store and the manifest are what is measured, not the disk);
- then the publisher's phases once more, timed apart on the same posts: the store reads
  (``gather``), decoding the shares, the merge (``merged_manifest``),
  ``encode_manifest`` and ``decode_manifest``;
- a restore onto the saving layout on three ranks, through ``read.indexes.ShardIndexes``
  (the index files it reads to find its own boxes, made on demand as their rank wrote
  them).

Store operations are counted by a wrapper around each connection (every call the
protocol makes). Writes ``benchmarks/results/scale.json`` and ``scale.png``; prints
a markdown table. Simulated ranks beat no heartbeat: all are alive and post at once.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import msgspec
from torch.distributed import PrefixStore, TCPStore

from benchmarks import scale_layout as layout
from checkpointd import tunables
from checkpointd.errors import CheckpointError
from checkpointd.format.manifest import Manifest, decode_manifest, encode_manifest
from checkpointd.ranks.attempt import Attempt, gather
from checkpointd.ranks.group import Group
from checkpointd.read.indexes import ShardIndexes
from checkpointd.storage.local import LocalStore
from checkpointd.write.ranked_commit import commit_ranked, component_digests
from checkpointd.write.ranked_merge import Share, indexed, merged_manifest

RESULTS = Path(__file__).parent / "results"
SWEEP = [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
QUICK = [8, 16, 32]
STEP = 1000


class CountingStore:
    """A c10d store that counts the calls made on it and the value bytes moved (its
    clones, the connection a rank waits on, count into the same)."""

    def __init__(self, store: Any, parent: CountingStore | None = None) -> None:
        self.store = store
        self.parent = parent
        self.calls: Counter[str] = Counter()
        self.bytes = 0
        self._lock = threading.Lock()

    def count(self, name: str, nbytes: int = 0) -> None:
        if self.parent is not None:
            self.parent.count(name, nbytes)
            return
        with self._lock:
            self.calls[name] += 1
            self.bytes += nbytes

    def clone(self) -> CountingStore:
        return CountingStore(self.store.clone(), self)

    def wait(self, keys: list[str], timeout: Any) -> None:
        self.count("wait")
        self.store.wait(keys, timeout)

    def set(self, key: str, value: bytes) -> None:
        self.count("set", len(value))
        self.store.set(key, value)

    def get(self, key: str) -> bytes:
        value: bytes = self.store.get(key)
        self.count("get", len(value))
        return value

    def check(self, keys: list[str]) -> bool:
        self.count("check")
        return bool(self.store.check(keys))

    def compare_set(self, key: str, expected: str, value: bytes) -> bytes:
        self.count("compare_set", len(value))
        held: bytes = self.store.compare_set(key, expected, value)
        return held

    def add(self, key: str, amount: int) -> int:
        self.count("add")
        return int(self.store.add(key, amount))

    @property
    def ops(self) -> int:
        return sum(self.calls.values())


class SimGroup(Group):
    """A simulated rank's Group: the real store calls, no heartbeat thread."""

    def __init__(self, store: Any, rank: int, world_size: int) -> None:  # no super(): no thread
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.publisher = 0
        self.token = layout.TOKEN
        self.ranks = tuple(range(world_size))
        self.join_seconds = tunables.JOIN_SECONDS
        self._waiter = store  # a simulated rank never waits

    def close(self) -> None:
        """Nothing to stop."""


def _client(port: int) -> CountingStore:
    """A connection of its own to the job's store, under the prefix a writer uses."""
    store = TCPStore("127.0.0.1", port, is_master=False, use_libuv=True)
    return CountingStore(PrefixStore("checkpointd/w0/", store))


def _post_bulk(port: int, mesh: layout.Mesh, ranks: list[int], clients: int) -> dict[str, Any]:
    """Every rank of ``ranks`` posts its digests and its share, as ``commit_ranked`` does;
    per rank the seconds and bytes of its share's post, and its store operations."""
    plan = layout.plan_of(0, mesh)
    digests = msgspec.json.encode(component_digests(plan))
    with_indexes = plan if indexed(plan, mesh.world) else None
    times: list[float] = []
    sizes: list[int] = []
    index_sizes: list[int] = []
    lock = threading.Lock()
    stores = [_client(port) for _ in range(clients)]

    def post(worker: int) -> None:
        store = stores[worker]
        for rank in ranks[worker::clients]:
            share = layout.share_of(rank, mesh, with_indexes)
            attempt = Attempt(SimGroup(store, rank, mesh.world), STEP, 0)
            store.store.set(f"{attempt.prefix}digest/{rank}", digests)
            before = store.bytes
            start = time.perf_counter()
            attempt.post("files", share)
            took = time.perf_counter() - start
            with lock:
                times.append(took)
                sizes.append(store.bytes - before)
                index_sizes.extend(f.size for f in share.files if f.path == share.index)

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(post, range(clients)))
    ops = sum(s.ops for s in stores)
    return {
        "post_s_median": statistics.median(times),
        "post_s_max": max(times),
        "post_bytes_median": statistics.median(sizes),
        "post_bytes_max": max(sizes),
        "post_ops_per_rank": (ops + len(ranks)) / len(ranks),  # + the digest set, uncounted
        "indexed": with_indexes is not None,
        "index_bytes_median": statistics.median(index_sizes) if index_sizes else 0,
        "index_bytes_max": max(index_sizes, default=0),
    }


async def _real_ranks(port: int, mesh: layout.Mesh, folder: Path) -> dict[str, Any]:
    """Rank 0 and the last rank run the real commit_ranked; their seconds and store use."""
    limiter = anyio.CapacityLimiter(4)
    store = LocalStore(str(folder))
    result: dict[str, Any] = {}

    async def run(rank: int, name: str) -> None:
        client = _client(port)
        start = time.perf_counter()
        group = Group(client, rank, mesh.world, layout.TOKEN, join_seconds=tunables.JOIN_SECONDS)
        try:
            info = await commit_ranked(
                store,
                layout.plan_of(rank, mesh),
                limiter,
                group,
                0,
                chunk_bytes=tunables.CHUNK_BYTES,
            )
        except CheckpointError as exc:  # a refused save fails on every rank alike
            result[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
            info = None
        finally:
            group.close()
        result[name] = {
            "seconds": time.perf_counter() - start,
            "ops": client.ops,
            "bytes": client.bytes,
            "calls": dict(client.calls),
            "components": None if info is None else len(info.components),
        }

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(run, 0, "publisher")
        tasks.start_soon(run, mesh.world - 1, "follower")
    return result


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def _phases(port: int, mesh: layout.Mesh) -> dict[str, Any]:
    """The publisher's phases again, apart, on the posts of the run just made."""
    client = _client(port)
    attempt = Attempt(SimGroup(client, 0, mesh.world), STEP, 0)
    everyone = list(range(mesh.world))
    read_s, posted = _timed(
        lambda: anyio.run(functools.partial(gather, attempt, "files", everyone, join=False))
    )
    reads = client.ops
    shares_s, shares = _timed(
        lambda: [msgspec.json.decode(posted[r], type=Share) for r in everyone]
    )
    plan = layout.plan_of(0, mesh)
    merge_s, manifest = _timed(lambda: merged_manifest(plan, mesh.world, shares, None))
    try:
        encode_s, data = _timed(lambda: encode_manifest(manifest))
    except CheckpointError as exc:  # over MAX_MANIFEST_BYTES: the publisher refuses it
        encode_s, data = _timed(lambda: msgspec.json.encode(manifest))
        row_refused: str | None = str(exc)
    else:
        row_refused = None
    row: dict[str, Any] = {
        "read_s": read_s,
        "read_ops": reads,
        "read_bytes": client.bytes,
        "decode_posts_s": shares_s,
        "merge_s": merge_s,
        "encode_s": encode_s,
        "manifest_bytes": len(data),
        "shards": layout.shard_count(mesh),
        "shards_inline": sum(
            len(t.shards) for c in manifest.components.values() for t in c.sharded.values()
        ),
        "indexes": len(manifest.shard_indexes),
    }
    row.update(_restores(manifest, mesh))
    if row_refused is not None:
        row["decode_s"], row["refused"] = None, row_refused
        return row
    try:
        row["decode_s"], _ = _timed(lambda: decode_manifest(data))
    except CheckpointError as exc:
        row["decode_s"], row["refused"] = None, str(exc)
    return row


class _SimSource:
    """The step's reader as read/indexes.py reads through it: the manifest of the model's
    save and each rank's index file, made on demand as that rank wrote it."""

    def __init__(self, manifest: Manifest, mesh: layout.Mesh) -> None:
        self.where = "scale model"
        self.folder = "000000001000"
        self.manifest = manifest
        self.files = {f.path: f for f in manifest.files}
        self.mesh = mesh
        self.bytes = 0
        self.store = self

    def read_into_sized(self, path: str, buffer: memoryview, offset: int = 0) -> int:
        """The index file at ``path`` (this source is its own store)."""
        data = layout.index_of(self.files[path.rsplit("/", 1)[1]].rank, self.mesh)
        assert data is not None
        self.bytes += len(data)
        buffer[:] = data[offset : offset + len(buffer)]
        return len(data)

    def check_digest(self, name: str, actual: int) -> None:
        assert actual == self.files[name].crc32c, name

    def vanished(self, name: str) -> CheckpointError:
        return CheckpointError(f"{name} vanished")


def _restores(manifest: Manifest, mesh: layout.Mesh) -> dict[str, Any]:
    """A restore onto the saving layout on ranks 0, the middle one and the last: the shard
    index files each reads to find its own boxes of every sharded tensor (the most of the
    three), their bytes, and the seconds its lookups take (``ShardIndexes.sharded``, given
    the ranks that hold the same box, as a restore's DTensor templates tell it)."""
    most: dict[str, Any] = {"restore_indexes": 0, "restore_index_bytes": 0, "restore_s": 0.0}
    for rank in sorted({0, mesh.world // 2, mesh.world - 1}):
        source = _SimSource(manifest, mesh)
        indexes = ShardIndexes(source)
        index = rank % mesh.shards  # the ranks holding the same box: its replicas
        near = [rank] + [index + k * mesh.shards for k in range(mesh.replicas)]
        start = time.perf_counter()
        for name, entry in manifest.components.items():
            for tensor, stored in entry.sharded.items():
                offset, rows = layout.chunk(stored.shape[0], mesh.shards, rank % mesh.shards)
                if rows:
                    box = ((offset, *[0] * (len(stored.shape) - 1)), (rows, *stored.shape[1:]))
                    indexes.sharded(name, tensor, stored, box, near)
        took = time.perf_counter() - start
        most["restore_indexes"] = max(most["restore_indexes"], indexes.loaded)
        most["restore_index_bytes"] = max(most["restore_index_bytes"], source.bytes)
        most["restore_s"] = max(most["restore_s"], took)
    return most


def run_case(world: int, kind: str, shard_group: int, clients: int, folder: Path) -> dict[str, Any]:
    """One simulated job: its bulk posts, the real publisher and follower, the phases."""
    mesh = layout.mesh_for(kind, world, shard_group)
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    row: dict[str, Any] = {"ranks": world, "layout": mesh.name}
    row.update(_post_bulk(server.port, mesh, list(range(1, world - 1)), min(clients, world - 2)))
    with tempfile.TemporaryDirectory(dir=folder) as root:
        row.update(anyio.run(_real_ranks, server.port, mesh, Path(root)))
    row.update(_phases(server.port, mesh))
    row["publisher_s"] = row["read_s"] + row["decode_posts_s"] + row["merge_s"] + row["encode_s"]
    del server
    return row


def _cells(row: dict[str, Any]) -> list[str]:
    """A row of the README's table."""
    mb = row["manifest_bytes"] / 1e6
    return [
        f"{row['ranks']:,}",
        row["layout"],
        f"{row['shards']:,}",
        f"{row['shards_inline']:,}",
        f"**{mb:,.1f} refused**" if row.get("refused") else f"{mb:,.1f}",
        f"{row['index_bytes_median'] / 1e3:,.0f}" if row["indexed"] else "-",
        f"{row['publisher_s']:.2f}",
        f"{row['publisher_s'] / row['ranks'] * 1e6:,.0f}",
        f"{row['read_ops']:,}",
        f"{row['post_bytes_median'] / 1e3:,.1f}",
        f"{row['follower']['ops']:,} ({row['follower']['calls'].get('wait', 0)})",
        f"{row['restore_indexes']} ({row['restore_index_bytes'] / 1e3:,.0f} KB)",
    ]


TITLES = (
    "ranks",
    "layout",
    "shard entries",
    "in manifest",
    "manifest MB",
    "index KB / rank",
    "publisher s",
    "µs / rank",
    "publisher store reads",
    "post KB / rank",
    "follower store ops (waits)",
    "indexes a restore reads",
)


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    lines = ["| " + " | ".join(TITLES) + " |", "|" + "---|" * len(TITLES)]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in rows]
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """Log-log plot of the publisher's time, the manifest's size and its store reads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for kind in dict.fromkeys(r["layout"].rstrip("0123456789x") for r in rows):
        mine = [r for r in rows if r["layout"].rstrip("0123456789x") == kind]
        ranks = [r["ranks"] for r in mine]
        axes[0].plot(ranks, [r["publisher_s"] for r in mine], "o-", label=kind)
        axes[1].plot(ranks, [r["manifest_bytes"] / 1e6 for r in mine], "o-", label=kind)
        axes[1].plot(
            ranks,
            [r["index_bytes_median"] / 1e6 or None for r in mine],
            "x--",
            label=f"{kind} index / rank",
        )
        axes[2].plot(ranks, [r["read_ops"] for r in mine], "o-", label=f"{kind} publisher")
        axes[2].plot(ranks, [r["follower_ops"] for r in mine], "x--", label=f"{kind} follower")
    axes[1].axhline(
        tunables.MAX_MANIFEST_BYTES / 1e6, color="red", ls=":", label="MAX_MANIFEST_BYTES"
    )
    for ax, title in zip(
        axes, ("publisher seconds", "manifest MB", "store operations"), strict=True
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help=f"ranks {QUICK} only (seconds)")
    parser.add_argument("--ranks", type=int, nargs="+", default=None)
    parser.add_argument("--layouts", nargs="+", default=["fsdp", "hsdp"], choices=["fsdp", "hsdp"])
    parser.add_argument("--shard-group", type=int, default=64, help="HSDP: ranks per shard group")
    parser.add_argument("--clients", type=int, default=8, help="store connections posting")
    parser.add_argument(
        "--inline",
        action="store_true",
        help="shard entries in the manifest at any size, as before shard indexes (schema 4)",
    )
    parser.add_argument(
        "--unchunked",
        action="store_true",
        help="post every value in one piece, as checkpointd did before ranks/values.py",
    )
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=RESULTS / "scale.json")
    parser.add_argument("--plot", type=Path, default=RESULTS / "scale.png")
    args = parser.parse_args(argv)
    if args.unchunked:
        tunables.STORE_VALUE_BYTES = 2**62
    if args.inline:
        tunables.SHARD_INDEX_MIN_ENTRIES = 2**62
    ranks = args.ranks or (QUICK if args.quick else SWEEP)
    shard_group = 8 if args.quick else args.shard_group
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="checkpointd-bench-", dir=args.dir) as folder:
        for kind in args.layouts:
            for world in ranks:
                if kind == "hsdp" and world <= shard_group and "fsdp" in args.layouts:
                    continue  # one shard group: the same job as FSDP2
                row = run_case(world, kind, shard_group, args.clients, Path(folder))
                row["follower_ops"] = row["follower"]["ops"]
                rows.append(row)
                print(table([row]).splitlines()[-1], flush=True)
                for side in ("publisher", "follower"):
                    if f"{side}_error" in row:
                        print(f"  {side}: {row[side + '_error']}", flush=True)
                if (row.get("refused") or "publisher_error" in row) and kind == "fsdp":
                    break  # larger jobs of this layout only refuse more
    print(table(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    info = {"shard_group": shard_group, "load_average": os.getloadavg(), "cpus": os.cpu_count()}
    args.json.write_text(json.dumps({**info, "rows": rows}, indent=2))
    plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
