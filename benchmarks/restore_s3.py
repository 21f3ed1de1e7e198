"""bench_restore's S3 rows: checkpointd.restore from S3 vs s3fs reading the same objects.

A moto server runs in a process of its own on loopback (so its CPU is not this
process's GIL). The model of ``mb`` MB (bench_restore's) is saved once with checkpointd;
then, interleaved per repetition: ``s3fs.cat_file`` of every object of the step folder,
one after another (s3fs's own defaults, which split an object over 50 MiB into
concurrent chunks), vs ``checkpointd.restore`` of the same step into a live model (the
manifest, then concurrent ranged GETs, every byte checked). A small checkpoint (two
``Linear(256, 256)`` and their AdamW state: 1.5 MiB) is also restored, for the "well
under a second" goal.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

import checkpointd
from benchmarks.common import Table, fmt_seconds

__all__ = ["moto_server", "report", "run"]


@contextmanager
def moto_server() -> Iterator[dict[str, Any]]:
    """A moto S3 server in its own process; yields s3fs storage options reaching it."""
    from tests.support.launch import free_port
    from tests.support.s3 import CREDENTIALS, REGION

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    options = {
        **CREDENTIALS,
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": REGION},
        "skip_instance_cache": True,
    }
    try:
        import boto3
        import botocore.exceptions

        client = boto3.client(
            "s3",
            endpoint_url=options["client_kwargs"]["endpoint_url"],
            aws_access_key_id=CREDENTIALS["key"],
            aws_secret_access_key=CREDENTIALS["secret"],
            region_name=REGION,
        )
        for attempt in range(400):
            try:
                client.create_bucket(Bucket="bench")
                break
            except botocore.exceptions.EndpointConnectionError:
                if attempt == 399:
                    raise
                time.sleep(0.05)
        yield options
    finally:
        server.terminate()
        server.wait(timeout=30)


def _small_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(2)))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer}


def run(
    build: Callable[[int, int | None], torch.nn.Module],
    d: int,
    reps: int,
    log: Callable[[str], None] = print,
) -> tuple[Table, int, int]:
    """The S3 series (seconds), the bytes of the step's objects and their count."""
    import s3fs

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    table = Table()
    with moto_server() as options:
        root, small_root = "s3://bench/ckpt", "s3://bench/small"
        model = build(d, 0)
        with checkpointd.CheckpointWriter(root, storage_options=options) as writer:
            writer.save(1, {"model": model}).result()
        small = _small_state()
        with checkpointd.CheckpointWriter(small_root, storage_options=options) as writer:
            writer.save(1, small).result()
        fs = s3fs.S3FileSystem(**options)
        objects = sorted(fs.find(f"{root.removeprefix('s3://')}/{1:012d}"))
        nbytes = sum(int(fs.info(o)["size"]) for o in objects)
        live = build(d, 1)
        small_live = _small_state()

        def s3fs_sequential() -> None:
            reader = s3fs.S3FileSystem(**options)  # a fresh client, as restore opens one
            started = time.perf_counter()
            for key in objects:
                reader.cat_file(key)
            table.add("s3fs.sequential", time.perf_counter() - started)

        def ours() -> None:
            started = time.perf_counter()
            checkpointd.restore(root, {"model": live}, storage_options=options)
            table.add("checkpointd.s3_restore", time.perf_counter() - started)

        def ours_small() -> None:
            started = time.perf_counter()
            checkpointd.restore(small_root, small_live, storage_options=options)
            table.add("checkpointd.s3_small", time.perf_counter() - started)

        ours()  # warm up (and check it restores what was saved)
        assert all(
            torch.equal(a, b)
            for a, b in zip(live.state_dict().values(), model.state_dict().values(), strict=True)
        )
        table.series.clear()
        jobs = [s3fs_sequential, ours, ours_small]
        for rep in range(reps):
            for job in jobs[rep % len(jobs) :] + jobs[: rep % len(jobs)]:
                job()
            log(f"  s3 rep {rep + 1}/{reps} done")
    return table, nbytes, len(objects)


def report(table: Table, nbytes: int, count: int) -> list[str]:
    """The S3 rows: seconds, throughput, the ratio the goal is on (>= 1.5x s3fs)."""
    mib = nbytes / 2**20
    theirs, ours = table["s3fs.sequential"], table["checkpointd.s3_restore"]
    speedup = theirs.median / ours.median
    mark = "ok" if speedup >= 1.5 else "MISSED (goal >= 1.5x)"
    small = table["checkpointd.s3_small"]
    small_mark = "ok" if small.median < 1.0 else "MISSED (goal well under 1 s)"
    return [
        f"S3 (moto in its own process; the step: {mib:.0f} MiB in {count} objects):",
        f"  {'s3fs.cat_file of each object, in turn':<44} {fmt_seconds(theirs)}"
        f"  {mib / theirs.median:6.1f} MiB/s",
        f"  {'checkpointd.restore':<44} {fmt_seconds(ours)}  {mib / ours.median:6.1f} MiB/s",
        f"  {'throughput: checkpointd / s3fs':<44} {speedup:6.2f}x  {mark}",
        f"  {'restore of a 1.5 MiB model + AdamW':<44} {fmt_seconds(small)}  {small_mark}",
    ]
