"""S3 save, side by side: checkpointd vs s3torchconnector's ``S3Checkpoint`` writer.

One moto server in its own process (``restore_s3.moto_server``). Interleaved per
repetition: checkpointd's ``CheckpointWriter`` on ``s3://`` saving the model until
committed (``save(...).result()``: parts uploaded, completed, manifest published) vs
``torch.save`` of the same state into ``S3Checkpoint(...).writer(uri)`` (AWS's CRT
client, path style, plain http on loopback, dummy credentials), timed until the
writer is closed (the object complete). A third contender is checkpointd with
``payload_signing_enabled=True``: every part SHA-256-signed as botocore does over plain
http by default (checkpointd's parts carry a signed CRC32C and go unsigned instead).
After each repetition, untimed, the repetition's objects are deleted, so moto (which
keeps every object in memory or temporary files) holds a few of them at a time.
``python -m benchmarks.save_s3_connector``; needs the ``bench`` extra (s3torchconnector).
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
    """Seconds and client CPU seconds per save of each contender, and the model's bytes."""
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
        # Over plain http botocore would SHA-256-sign every part (checkpointd sends them
        # unsigned with a signed CRC32C): the third contender asks for signing.
        signed = {**options, "config_kwargs": {"s3": {"payload_signing_enabled": True}}}
        writer = checkpointd.CheckpointWriter(
            "s3://bench/ckpt", storage_options=options, keep_last=None
        )
        writer_signed = checkpointd.CheckpointWriter(
            "s3://bench/signed", storage_options=signed, keep_last=None
        )
        steps = iter(range(1, 3 * reps + 10))

        def ours() -> None:
            writer.save(next(steps), {"model": model}).result()

        def ours_signed() -> None:
            writer_signed.save(next(steps), {"model": model}).result()

        def theirs() -> None:
            with connector.writer(f"s3://bench/torch/{next(steps)}.pt") as stream:
                torch.save(model.state_dict(), stream)

        jobs = {
            "checkpointd.s3_save": ours,
            "checkpointd.s3_save_signed": ours_signed,
            "s3torchconnector.s3_save": theirs,
        }
        try:
            for job in jobs.values():
                job()  # warm up every client (connections, the CRT's thread pool)
            _check_written(options, nbytes)
            names = list(jobs)
            for rep in range(reps):
                _delete_all(options)
                for name in names[rep % 3 :] + names[: rep % 3]:
                    wall, cpu = time.perf_counter(), time.process_time()
                    jobs[name]()
                    table.add(name, time.perf_counter() - wall)
                    table.add(name + ".cpu", time.process_time() - cpu)
        finally:
            writer.close()
            writer_signed.close()
    return table, nbytes


def _check_written(options: dict[str, Any], nbytes: int) -> None:
    """Every warm-up save left at least the model's bytes on the server."""
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    for prefix in ("bench/ckpt", "bench/signed", "bench/torch"):
        stored = sum(int(info["size"]) for info in fs.find(prefix, detail=True).values())
        if stored < nbytes:
            raise RuntimeError(f"{prefix}: {stored} bytes stored, the model has {nbytes}")


def _delete_all(options: dict[str, Any]) -> None:
    """Delete every object in the bucket (untimed; the writers keep no state there)."""
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    fs.rm(fs.find("bench"))


def report(table: Table, nbytes: int) -> list[str]:
    """The rows: seconds, MiB/s, the ratio the goal is on (checkpointd >= 1.0x theirs)."""
    mib = nbytes / 2**20
    rows = [
        ("checkpointd.s3_save", "checkpointd save until committed"),
        ("checkpointd.s3_save_signed", "  same, payload_signing_enabled=True"),
        ("s3torchconnector.s3_save", "s3torchconnector S3Checkpoint + torch.save"),
    ]
    lines = [f"S3 save to moto (own process), {mib:.0f} MiB model (client CPU s in this process):"]
    for name, label in rows:
        wall, cpu = table[name], table[name + ".cpu"]
        lines.append(
            f"  {label:<44} {fmt_seconds(wall)}  {mib / wall.median:6.1f} MiB/s"
            f"  cpu {cpu.median:.2f} s"
        )
    theirs = table["s3torchconnector.s3_save"].median
    for name, label in (rows[0][0], "checkpointd"), (rows[1][0], "signed"):
        ratio = theirs / table[name].median
        mark = "ok" if ratio >= 1.0 else "MISSED (goal >= 1.0x)"
        lines.append(
            f"  {'throughput: ' + label + ' / s3torchconnector':<44} {ratio:6.2f}x  {mark}"
        )
    return lines


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
