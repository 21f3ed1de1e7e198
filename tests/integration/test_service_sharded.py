"""DTensor shards through the checkpoint service: a real 2-rank gloo FSDP2 job
(tests/support/shard_job.py) whose ranks each save through their own real
``checkpointd serve``. The files must be byte-identical to an in-process save's,
restore (in-process, on 2 ranks and resharded on 3) must give the state back bit for
bit, and a save whose ``save()`` returned must commit after kill -9 of both trainers.
The trainer's shard block size (not the services' default) is the one written. The
same with ``staging="overlapped"`` (a training step while the copy runs) and with an
AsyncCheckpointWriter.
Also tensor-parallel and HSDP (4 ranks: replicas write alternate shards) jobs, and
FSDP2 to S3 (moto) through the services.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

import checkpointd
from checkpointd import tunables
from checkpointd.daemon.client.client import status
from checkpointd.read import catalog
from checkpointd.storage import open_store
from tests.integration.test_sharded import BLOCK, check_restored, job, same
from tests.support.launch import hosted_store
from tests.support.s3 import MotoS3
from tests.support.service import kill_ranks_at_line, rank_processes, services_per_rank

WORLD = 2

# Each test runs one or two jobs of 2 to 4 rank processes beside as many services:
# up to 100 s measured on 2 shared cores at load average 10, near the default 120 s.
pytestmark = pytest.mark.timeout(300)


def _saved_both_ways(base: Path, **env: str) -> tuple[Path, Path, Path]:
    """The same FSDP2 job (shard blocks of test_sharded's BLOCK bytes, not the services'
    default) saved through the services and in-process, with the writer ``env`` asks for:
    (service root, its job's output folder, in-process root)."""
    assert BLOCK != tunables.SHARD_BLOCK_BYTES  # the trainer's own setting
    with services_per_rank(WORLD) as services:
        sockets = ",".join(s.socket for s in services)
        out = job(
            "save", "fsdp2", str(base / "svc"), base / "save", WORLD,
            CHECKPOINTD_TEST_SERVICES=sockets, **env,
        )  # fmt: skip
        assert [status(s.socket).committed for s in services] == [1, 1]
    job("save", "fsdp2", str(base / "local"), base / "save_local", WORLD, **env)
    return base / "svc", out, base / "local"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A CheckpointWriter's FSDP2 save through the services and in-process."""
    return _saved_both_ways(tmp_path_factory.mktemp("fsdp2_service"))


@pytest.fixture(scope="module")
def overlapped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """As ``saved`` with ``staging="overlapped"``: the copy held until ``save()``
    returned, then one training step while it runs."""
    base = tmp_path_factory.mktemp("fsdp2_overlapped")
    return _saved_both_ways(base, CHECKPOINTD_TEST_STAGING="overlapped")


def _token_free(root: Path, step: int) -> tuple[dict[str, Any], dict[str, bytes]]:
    """A committed step's manifest and its files by name, with what differs from save to
    save taken out: the attempt token (in file names), the creation time, the writer's
    random lineage and writer ids, and the manifest's own CRC32C (over those)."""
    folder = root / f"{step:012d}"
    manifest = msgspec.json.decode((folder / "manifest.json").read_bytes())
    tokens = {f["path"].split(".")[1] for f in manifest["files"]}
    assert len(tokens) == 1, tokens
    (token,) = tokens
    for key in ("created_at", "lineage", "writer", "manifest_crc32c"):
        manifest.pop(key)
    text = re.sub(re.escape(token), "TOKEN", json.dumps(manifest, sort_keys=True))
    files = {
        f.name.replace(token, "TOKEN"): f.read_bytes()
        for f in folder.iterdir()
        if f.name != "manifest.json"
    }
    return json.loads(text), files


def _same_files(svc: Path, local: Path) -> None:
    """The services wrote the files and manifest the in-process save wrote, shard blocks
    of the trainer's size."""
    svc_manifest, svc_files = _token_free(svc, 1)
    local_manifest, local_files = _token_free(local, 1)
    assert svc_manifest == local_manifest
    assert svc_files.keys() == local_files.keys()
    shard_files = [name for name in svc_files if ".rank" in name]
    assert len(shard_files) == 2 * WORLD, sorted(svc_files)  # model and optimizer, per rank
    for name, data in svc_files.items():
        assert data == local_files[name], name
    assert svc_manifest["world_size"] == WORLD
    blocks = {
        shard["block_bytes"]
        for component in svc_manifest["components"].values()
        for tensor in component["sharded"].values()
        for shard in tensor["shards"]
    }
    assert blocks == {BLOCK}


def test_fsdp2_through_the_service_writes_the_files_an_in_process_save_writes(
    saved: tuple[Path, Path, Path],
) -> None:
    svc, _, local = saved
    _same_files(svc, local)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("made", ["saved", "overlapped"])
def test_fsdp2_through_the_service_restores_bit_exact(
    made: str, world: int, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Saved in order or with staging=overlapped, restored on the saving world size and
    on another."""
    svc, out, _ = request.getfixturevalue(made)
    check_restored(out, job("restore", "fsdp2", str(svc), tmp_path / "restore", world))


def test_fsdp2_overlapped_through_the_service_writes_what_in_process_writes(
    overlapped: tuple[Path, Path, Path],
) -> None:
    svc, out, local = overlapped
    for rank in range(WORLD):
        report = json.loads((out / f"rank{rank}.json").read_text())
        assert report["staged_at_return"] is False, report  # handed over after return
    _same_files(svc, local)


def test_fsdp2_async_writer_through_the_service_writes_what_in_process_writes(
    saved: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    root = tmp_path / "root"
    with services_per_rank(WORLD) as services:
        sockets = ",".join(s.socket for s in services)
        out = job(
            "save", "fsdp2", str(root), tmp_path / "save", WORLD,
            CHECKPOINTD_TEST_SERVICES=sockets, CHECKPOINTD_TEST_ASYNC="1",
        )  # fmt: skip
        assert [status(s.socket).committed for s in services] == [1, 1]
    _same_files(root, saved[2])  # the sync writer's in-process save of the same state
    check_restored(out, job("restore", "fsdp2", str(root), tmp_path / "restore", WORLD))


@pytest.fixture
def job_store() -> Iterator[int]:
    with hosted_store() as port:
        yield port


def test_fsdp2_trainers_killed_after_save_returned_still_commit(
    job_store: int, tmp_path: Path
) -> None:
    root, out, gate = tmp_path / "root", tmp_path / "out", tmp_path / "gate"
    out.mkdir()
    steps = 2
    # The services' writes wait for the gate: every save is in flight when the ranks die.
    with services_per_rank(WORLD, gate=str(gate)) as services:
        procs = rank_processes(
            "tests.support.service_fsdp_job",
            services,
            out,
            job_store,
            after=[str(root), str(out), str(steps)],
        )
        kill_ranks_at_line(procs, f"returned {steps}", out)  # every save() returned
        assert all(status(s.socket).saves_in_flight > 0 for s in services)
        assert checkpointd.list_checkpoints(str(root)) == [] if root.is_dir() else True
        gate.touch()
        deadline = time.monotonic() + 120
        while any(status(s.socket).saves_in_flight for s in services):
            assert time.monotonic() < deadline, [s.log_text() for s in services]
            time.sleep(0.05)
        assert [c.step for c in checkpointd.list_checkpoints(str(root))] == list(
            range(1, steps + 1)
        )
        assert all(status(s.socket).failed == 0 for s in services)
    for step in range(1, steps + 1):
        expected = torch.load(out / f"expected{step}.pt")
        loaded = checkpointd.load(str(root), step)
        same(expected["model"], loaded.state["model"])
        same(expected["optimizer"], loaded.state["optimizer"]["state"])


@pytest.mark.parametrize(("mode", "world"), [("tp", 2), ("hsdp", 4)])
def test_tensor_parallel_and_hsdp_through_the_service_restore_bit_exact(
    mode: str, world: int, tmp_path: Path
) -> None:
    root = str(tmp_path / "root")
    with services_per_rank(world) as services:
        sockets = ",".join(s.socket for s in services)
        saved = job("save", mode, root, tmp_path / "save", world, CHECKPOINTD_TEST_SERVICES=sockets)
    if mode == "hsdp":
        manifest = catalog.read_manifest(open_store(root), 1)
        for component in ("model", "optimizer"):
            for name, tensor in manifest.components[component].sharded.items():
                assert len(tensor.shards) == 2, name  # Shard(0) over 2, replicated twice
        assert {f.rank for f in manifest.files if ".rank" in f.path} == {0, 1, 2, 3}
    check_restored(saved, job("restore", mode, root, tmp_path / "restore", world))


def test_fsdp2_through_the_service_to_s3_restores_resharded(
    moto_s3: MotoS3, tmp_path: Path
) -> None:
    bucket = f"svc-sharded-{tmp_path.name[-16:].lower().replace('_', '-')}"
    moto_s3.create_bucket(bucket)
    root = f"s3://{bucket}/run"
    options = {"CHECKPOINTD_TEST_OPTIONS": json.dumps(moto_s3.storage_options())}
    with services_per_rank(WORLD) as services:
        sockets = ",".join(s.socket for s in services)
        saved = job(
            "save", "fsdp2", root, tmp_path / "save", WORLD,
            CHECKPOINTD_TEST_SERVICES=sockets, **options,
        )  # fmt: skip
        assert [status(s.socket).committed for s in services] == [1, 1]
    check_restored(saved, job("restore", "fsdp2", root, tmp_path / "restore", 3, **options))
