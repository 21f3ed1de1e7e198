"""S3 save, side by side: checkpointd vs s3torchconnector's ``S3Checkpoint`` writer.

One moto server in its own process (``restore_s3.moto_server``). Interleaved per
repetition: checkpointd's ``CheckpointWriter`` on ``s3://`` saving the model until
committed (``save(...).result()``: parts uploaded, completed, manifest published) vs
``torch.save`` of the same state into ``S3Checkpoint(...).writer(uri)`` (AWS's CRT
client, path style, plain http on loopback, dummy credentials), timed until the
writer is closed (the object complete). ``python -m benchmarks.save_s3_connector``;
needs the ``bench`` extra (s3torchconnector).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any

import torch

import checkpointd
from benchmarks.bench_restore import build, width_for
from benchmarks.common import Table, fmt_seconds
from benchmarks.restore_s3 import moto_server

__all__ = ["report", "run"]


def run(mb: float, reps: int) -> tuple[Table, int]:
    """The two series (seconds per save) and the model's bytes; reps interleaved, rotated."""
    from s3torchconnector import S3Checkpoint, S3ClientConfig
    from tests.support.s3 import CREDENTIALS, REGION

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    model = build(width_for(mb), 0)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    table = Table()
    with moto_server() as options:
        # The CRT client reads credentials from the environment only.
        os.environ["AWS_ACCESS_KEY_ID"] = CREDENTIALS["key"]
        os.environ["AWS_SECRET_ACCESS_KEY"] = CREDENTIALS["secret"]
        endpoint = options["client_kwargs"]["endpoint_url"]
        connector = S3Checkpoint(
            REGION, endpoint=endpoint, s3client_config=S3ClientConfig(force_path_style=True)
        )
        writer = checkpointd.CheckpointWriter(
            "s3://bench/ckpt", storage_options=options, keep_last=None
        )
        steps = iter(range(1, 2 * reps + 10))

        def ours() -> float:
            started = time.perf_counter()
            writer.save(next(steps), {"model": model}).result()
            return time.perf_counter() - started

        def theirs() -> float:
            started = time.perf_counter()
            with connector.writer(f"s3://bench/torch/{next(steps)}.pt") as stream:
                torch.save(model.state_dict(), stream)
            return time.perf_counter() - started

        jobs = {"checkpointd.s3_save": ours, "s3torchconnector.s3_save": theirs}
        try:
            for job in jobs.values():
                job()  # warm up both clients (connections, the CRT's thread pool)
            _check_written(options, nbytes)
            names = list(jobs)
            for rep in range(reps):
                for name in names[rep % 2 :] + names[: rep % 2]:
                    table.add(name, jobs[name]())
        finally:
            writer.close()
    return table, nbytes


def _check_written(options: dict[str, Any], nbytes: int) -> None:
    """Both warm-up saves left at least the model's bytes on the server."""
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    for prefix in ("bench/ckpt", "bench/torch"):
        stored = sum(int(info["size"]) for info in fs.find(prefix, detail=True).values())
        if stored < nbytes:
            raise RuntimeError(f"{prefix}: {stored} bytes stored, the model has {nbytes}")


def report(table: Table, nbytes: int) -> list[str]:
    """The rows: seconds, MiB/s, the ratio the goal is on (checkpointd >= 1.0x theirs)."""
    mib = nbytes / 2**20
    ours, theirs = table["checkpointd.s3_save"], table["s3torchconnector.s3_save"]
    ratio = theirs.median / ours.median
    mark = "ok" if ratio >= 1.0 else "MISSED (goal >= 1.0x)"
    return [
        f"S3 save to moto (own process), {mib:.0f} MiB model:",
        f"  {'checkpointd save until committed':<44} {fmt_seconds(ours)}"
        f"  {mib / ours.median:6.1f} MiB/s",
        f"  {'s3torchconnector S3Checkpoint + torch.save':<44} {fmt_seconds(theirs)}"
        f"  {mib / theirs.median:6.1f} MiB/s",
        f"  {'throughput: checkpointd / s3torchconnector':<44} {ratio:6.2f}x  {mark}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--mb", type=float, default=256.0, help="model size in MB (1e6 bytes)")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    table, nbytes = run(args.mb, args.reps)
    print("\n".join(report(table, nbytes)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
