"""How many manifests load/restore of the newest checkpoint read, on a root of many checkpoints.

Builds a root of ``--count`` committed checkpoints cheaply (one real save of a tiny
state, then its folder copied with the manifest re-stamped for each step), on local
disk and on S3 (moto in server mode on loopback), then prints manifest reads and
wall time for ``load`` and ``restore`` of the newest step and for ``list_checkpoints``
(which reads every manifest by design). Uses only the public API plus a count of
``checkpointd.read.catalog.read_manifest`` calls, so the same script measures an older
checkout (``PYTHONPATH=<old>/src``) for a before/after comparison.

    PYTHONPATH=src python -m benchmarks.bench_catalog --count 1000 [--no-s3]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import torch

import checkpointd
from checkpointd.format.manifest import MANIFEST_NAME, decode_manifest, encode_manifest
from checkpointd.read import catalog
from checkpointd.storage import open_store

STATE_STEP = 1


def build_root(url: str, options: dict[str, Any] | None, count: int) -> None:
    """``count`` committed checkpoints at steps 1..count, copies of one real tiny save."""
    state = {"model": {"w": torch.arange(4.0)}, "extra": {"epoch": 0}}
    with checkpointd.CheckpointWriter(url, storage_options=options) as writer:
        writer.save(STATE_STEP, state).result(timeout=60)
    store = open_store(url, options)
    try:
        folder = f"{STATE_STEP:012d}"
        names = [n for n in store.list_dir(folder) if n != MANIFEST_NAME]
        files = {n: store.read_bytes(f"{folder}/{n}") for n in names}
        manifest = decode_manifest(store.read_bytes(f"{folder}/{MANIFEST_NAME}"))

        def copy(step: int) -> None:
            target = f"{step:012d}"
            store.make_dir(target)
            for name, data in files.items():
                sink = store.open_file(f"{target}/{name}", len(data))
                sink.write(data)
                sink.commit()
            stamped = msgspec.structs.replace(manifest, step=step)
            store.publish(f"{target}/{MANIFEST_NAME}", encode_manifest(stamped))

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(copy, range(STATE_STEP + 1, count + 1)))
    finally:
        store.close()


@contextmanager
def counting_reads() -> Iterator[list[int]]:
    """Count calls of catalog.read_manifest (every manifest read of load/restore/list)."""
    calls: list[int] = []
    original = catalog.read_manifest

    def counted(store: Any, step: int) -> Any:
        calls.append(step)
        return original(store, step)

    catalog.read_manifest = counted  # type: ignore[assignment]
    try:
        yield calls
    finally:
        catalog.read_manifest = original  # type: ignore[assignment]


def measure(name: str, fn: Callable[[], Any]) -> None:
    with counting_reads() as calls:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
    print(f"  {name:<22} {len(calls):>6} manifest reads  {elapsed * 1000:8.0f} ms", flush=True)


def run(label: str, url: str, options: dict[str, Any] | None, count: int) -> None:
    start = time.perf_counter()
    build_root(url, options, count)
    print(f"{label}: {count} checkpoints (built in {time.perf_counter() - start:.1f} s)")
    targets = {"model": {"w": torch.zeros(4)}, "extra": {}}
    measure("load newest", lambda: checkpointd.load(url, storage_options=options))
    measure(
        "restore newest",
        lambda: checkpointd.restore(url, targets, storage_options=options),
    )
    measure("load step=1", lambda: checkpointd.load(url, 1, storage_options=options))
    measure("list_checkpoints", lambda: checkpointd.list_checkpoints(url, storage_options=options))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--no-s3", action="store_true", help="local disk only")
    args = parser.parse_args()
    print(f"checkpointd {checkpointd.__version__} from {checkpointd.__file__}")
    with tempfile.TemporaryDirectory() as folder:
        run("local", folder, None, args.count)
    if args.no_s3:
        return
    from tests.support.s3 import start_moto

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's access log
    moto = start_moto()
    try:
        moto.create_bucket("bench")
        run("s3 (moto)", "s3://bench/root", moto.storage_options(), args.count)
    finally:
        moto.stop()


if __name__ == "__main__":
    main()
