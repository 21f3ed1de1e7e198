"""A many-rank job restores from its nodes' memory tiers: real 2-rank gloo FSDP2 jobs
whose ranks each save through their own real ``checkpointd serve`` (one "node" each),
then restore with ``service=`` that node's socket. Each rank's service holds its share
(its shards, the replicated files); a restore reads those from shared memory, the rest
from storage, and must give the state back bit for bit (gathered to whole tensors by
torch.distributed.checkpoint.state_dict). A damaged held byte, or a step committed
again on storage with other bytes under the same names, is never served from memory.
Also: ranks sharing one service, shard index files, and a root on S3 (moto).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from checkpointd.daemon.client.client import status
from checkpointd.format.manifest import Manifest, decode_manifest, encode_manifest
from tests.integration.test_sharded import check_restored, job, same
from tests.support.launch import hosted_store
from tests.support.s3 import MotoS3
from tests.support.service import (
    Service,
    damage_held_copy,
    held_files,
    kill_ranks_at_line,
    rank_processes,
    running_service,
    services_per_rank,
)

WORLD = 2
STEPS = 2

# Each test runs one to three jobs of 2 or 3 rank processes beside their services.
pytestmark = pytest.mark.timeout(300)


def _settled(services: list[Service], step: int) -> None:
    """Wait until no save is in flight and every service holds ``step``."""
    deadline = time.monotonic() + 120
    while True:
        replies = [status(s.socket) for s in services]
        if all(not r.saves_in_flight and [step] in r.kept.values() for r in replies):
            return
        assert time.monotonic() < deadline, [s.log_text()[-3000:] for s in services]
        time.sleep(0.05)


def _killed_after_saving(
    services: list[Service], root: Path, out: Path, steps: int, port: int
) -> None:
    """Trainers (tests.support.service_fsdp_job) save steps 1..``steps`` through
    ``services`` and are killed -9 once every save() returned; the services commit."""
    procs = rank_processes(
        "tests.support.service_fsdp_job",
        services,
        out,
        port,
        after=[str(root), str(out), str(steps)],
    )
    kill_ranks_at_line(procs, f"returned {steps}", out)
    _settled(services, steps)
    assert all(status(s.socket).failed == 0 for s in services)


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, list[Service]]]:
    """FSDP2 steps 1..2 saved through one service per rank by trainers killed once every
    save() returned: (root, the output folder with expected{step}.pt, the services, which
    hold step 2)."""
    base = tmp_path_factory.mktemp("fsdp2_held")
    root, out = base / "root", base / "out"
    with hosted_store() as port, services_per_rank(WORLD) as services:
        _killed_after_saving(services, root, out, STEPS, port)
        yield root, out, services


def _sources(out: Path, world: int) -> list[str]:
    return [json.loads((out / f"rank{r}.json").read_text())["source"] for r in range(world)]


def _shard_bytes_read(out: Path, world: int) -> list[int]:
    """Bytes each rank read from shard files on storage (not from memory)."""
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    return [r["shard_bytes_read"] for r in reports]


def _same_as(expected: Path, restored: Path) -> None:
    """The restored state (``restore.pt``) is bit for bit the state in ``expected``."""
    want = torch.load(expected)
    got = torch.load(restored / "restore.pt")
    same(want["model"], got["model"])
    same(want["optimizer"], got["optimizer"])


def test_restarted_ranks_restore_from_their_services_bit_exact(
    held: tuple[Path, Path, list[Service]], tmp_path: Path
) -> None:
    root, out, services = held
    sockets = ",".join(s.socket for s in services)
    restored = job(
        "restore", "fsdp2", str(root), tmp_path / "r", WORLD, CHECKPOINTD_TEST_SERVICES=sockets
    )
    assert _sources(restored, WORLD) == ["memory", "memory"]
    assert _shard_bytes_read(restored, WORLD) == [0, 0]  # not one shard byte from storage
    _same_as(out / f"expected{STEPS}.pt", restored)
    # the same restore without the services reads storage, to the same state
    plain = job("restore", "fsdp2", str(root), tmp_path / "plain", WORLD)
    assert _sources(plain, WORLD) == ["storage", "storage"]
    _same_as(out / f"expected{STEPS}.pt", plain)


def test_resharded_on_3_ranks_reads_memory_where_held_and_storage_for_the_rest(
    held: tuple[Path, Path, list[Service]], tmp_path: Path
) -> None:
    root, out, services = held
    # Rank 2 runs on a new node: its service holds nothing. Rows of 24 and 10 over 3
    # ranks: rank 0's lie in saved rank 0's shards, rank 1's straddle both saved
    # ranks', rank 2's lie in saved rank 1's (held on another node only). A share a
    # rank's node lacks comes from the node that holds it (the restore joins the job's
    # services as peers); the new node's rank reads the files every rank holds alike
    # (trees) from storage before it has a share that holds them.
    with running_service() as fresh:
        sockets = ",".join([*(s.socket for s in services), fresh.socket])
        restored = job(
            "restore", "fsdp2", str(root), tmp_path / "r", 3, CHECKPOINTD_TEST_SERVICES=sockets
        )
    assert _sources(restored, 3) == ["memory", "memory+peer", "peer+storage"]
    assert _shard_bytes_read(restored, 3) == [0, 0, 0]
    _same_as(out / f"expected{STEPS}.pt", restored)


def test_a_damaged_held_file_falls_back_to_storage_bit_exact(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    with services_per_rank(WORLD) as services:
        sockets = ",".join(s.socket for s in services)
        saved = job(
            "save", "fsdp2", root, tmp_path / "save", WORLD, CHECKPOINTD_TEST_SERVICES=sockets
        )
        _settled(services, 1)
        damaged = damage_held_copy(services[0].proc.pid, services[0].socket, root, 1)
        assert ".rank0." in damaged  # one of rank 0's shard files
        restored = job(
            "restore", "fsdp2", root, tmp_path / "r", WORLD, CHECKPOINTD_TEST_SERVICES=sockets
        )
    # rank 0's restore found the damage and read all of it from storage; rank 1's copy
    # was whole
    assert _sources(restored, WORLD) == ["storage", "memory"]
    check_restored(saved, restored)


def test_ranks_sharing_one_service_each_restore_their_own_share(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    with running_service() as service:  # both ranks on one node
        sockets = ",".join([service.socket] * WORLD)
        saved = job(
            "save", "fsdp2", root, tmp_path / "save", WORLD, CHECKPOINTD_TEST_SERVICES=sockets
        )
        _settled([service], 1)
        assert list(status(service.socket).kept.values()) == [[1]]  # one step, two shares
        restored = job(
            "restore", "fsdp2", root, tmp_path / "r", WORLD, CHECKPOINTD_TEST_SERVICES=sockets
        )
    assert _sources(restored, WORLD) == ["memory", "memory"]
    assert _shard_bytes_read(restored, WORLD) == [0, 0]
    check_restored(saved, restored)


def _renamed(folder: Path, old: str, new: str) -> None:
    """Rename step ``folder``'s files from attempt token ``old`` to ``new`` and publish
    its manifest again listing them so (the same bytes under other names)."""
    manifest = decode_manifest((folder / "manifest.json").read_bytes())
    for path in folder.iterdir():
        if old in path.name:
            path.rename(folder / path.name.replace(old, new))
    text = msgspec.json.encode(manifest).decode().replace(old, new)
    (folder / "manifest.json").write_bytes(
        encode_manifest(msgspec.json.decode(text, type=Manifest))
    )


def _token(folder: Path) -> str:
    manifest: dict[str, Any] = msgspec.json.decode((folder / "manifest.json").read_bytes())
    (token,) = {f["path"].split(".")[1] for f in manifest["files"]}
    return token


def test_a_step_committed_again_with_other_bytes_is_never_served_from_memory(
    tmp_path: Path,
) -> None:
    root, other = tmp_path / "root", tmp_path / "other"
    with services_per_rank(WORLD) as services:
        sockets = ",".join(s.socket for s in services)
        # step 1 held: the state after two training steps
        job("save", "fsdp2", str(root), tmp_path / "save", WORLD, CHECKPOINTD_TEST_SERVICES=sockets)
        _settled(services, 1)
        held_token = _token(root / f"{1:012d}")
        # step 1 saved elsewhere after three training steps, then committed as root's
        # step 1 under the very file names the services hold
        again = job(
            "save", "fsdp2", str(other), tmp_path / "again", WORLD, CHECKPOINTD_TEST_TRAIN_STEPS="3"
        )
        folder = other / f"{1:012d}"
        _renamed(folder, _token(folder), held_token)
        (root / f"{1:012d}").rename(tmp_path / "replaced")
        folder.rename(root / f"{1:012d}")
        listed = decode_manifest((root / f"{1:012d}" / "manifest.json").read_bytes()).files
        stored = {f.path: (f.size, f.crc32c) for f in listed}
        held = {
            f.path: (len(f.head) + f.length, f.crc32c)
            for f in held_files(services[0].socket, str(root), 1)
        }
        same_bytes = sorted(path for path in held if stored.get(path) == held[path])
        other_bytes = sorted(
            path for path in held if path in stored and stored[path][0] == held[path][0]
        )
        other_bytes = [path for path in other_bytes if path not in same_bytes]
        # the hard case: rank 0's shard files under the same paths and sizes, other CRC32Cs;
        # files whose bytes did not change (the trees of the model and the progress) agree
        assert [path for path in other_bytes if ".rank0." in path], other_bytes
        assert same_bytes, held
        assert not [path for path in same_bytes if ".rank" in path]
        restored = job(
            "restore", "fsdp2", str(root), tmp_path / "r", WORLD, CHECKPOINTD_TEST_SERVICES=sockets
        )
    # Only the unchanged files came from memory (a rule of path and size alone would have
    # served the stale shards: restore's CRC32C check would then have failed the memory
    # copy as a whole, "storage"); every shard byte came from storage, and the state is
    # the one committed again.
    assert _sources(restored, WORLD) == ["memory+storage", "memory+storage"]
    assert all(read > 0 for read in _shard_bytes_read(restored, WORLD))
    check_restored(again, restored)


def test_shard_index_files_are_held_with_their_ranks_shares(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    # The trainers' SHARD_INDEX_MIN_ENTRIES of 0 puts the shard entries in per-rank index
    # files; the services keep their own default, so this also shows the trainer's wins.
    index = {"CHECKPOINTD_TEST_SHARD_INDEX": "1"}
    with services_per_rank(WORLD) as services:
        sockets = ",".join(s.socket for s in services)
        saved = job(
            "save", "fsdp2", root, tmp_path / "save", WORLD,
            CHECKPOINTD_TEST_SERVICES=sockets, **index,
        )  # fmt: skip
        _settled(services, 1)
        for rank, service in enumerate(services):
            names = [f.path for f in held_files(service.socket, root, 1)]
            assert [n for n in names if n.startswith("shards.")] == [
                n for n in names if n.startswith("shards.") and n.endswith(f".rank{rank}.json")
            ]
            assert [n for n in names if n.startswith("shards.")], names
        restored = job(
            "restore", "fsdp2", root, tmp_path / "r", WORLD,
            CHECKPOINTD_TEST_SERVICES=sockets, **index,
        )  # fmt: skip
    manifest = decode_manifest((Path(root) / f"{1:012d}" / "manifest.json").read_bytes())
    assert len(manifest.shard_indexes) == WORLD  # the shard entries are in the indexes
    reports = [json.loads((restored / f"rank{r}.json").read_text()) for r in range(WORLD)]
    # each rank read its own index and shards, all from its service's memory
    assert [(r["source"], r["indexes_read"], r["shard_bytes_read"]) for r in reports] == [
        ("memory", [], 0)
    ] * WORLD
    check_restored(saved, restored)


def test_on_s3_a_resharded_restore_reads_memory_where_held_and_s3_for_the_rest(
    moto_s3: MotoS3, tmp_path: Path
) -> None:
    bucket = f"svc-held-{tmp_path.name[-16:].lower().replace('_', '-')}"
    moto_s3.create_bucket(bucket)
    root = f"s3://{bucket}/run"
    options = {"CHECKPOINTD_TEST_OPTIONS": json.dumps(moto_s3.storage_options())}
    with services_per_rank(WORLD) as services, running_service() as fresh:
        sockets = ",".join(s.socket for s in services)
        saved = job(
            "save", "fsdp2", root, tmp_path / "save", WORLD,
            CHECKPOINTD_TEST_SERVICES=sockets, **options,
        )  # fmt: skip
        _settled(services, 1)
        sockets = ",".join([*(s.socket for s in services), fresh.socket])
        restored = job(
            "restore",
            "fsdp2",
            root,
            tmp_path / "r",
            3,
            CHECKPOINTD_TEST_SERVICES=sockets,
            **options,
        )
    assert _sources(restored, 3) == ["memory", "memory+peer", "peer+storage"]
    check_restored(saved, restored)
