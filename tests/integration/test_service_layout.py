"""The tunables that decide a save's files are the trainer's, also through the service,
as they were when the writer was made (write/options.SaveTarget): a trainer that changed
INCREMENTAL_MIN_BYTES, DIRECT_MIN_BYTES, SHARD_BLOCK_BYTES or SHARD_INDEX_MIN_ENTRIES
gets the files an in-process save writes, not those of the service's own values (which
are left at their defaults here)."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

import checkpointd
from checkpointd import tunables
from checkpointd.errors import InvalidArgumentError
from checkpointd.format.layout import DIRECT_ALIGN
from tests.support.service import files_by_component, running_service

_TOKEN = re.compile(r"\.[0-9a-f]{8,}\.")  # an attempt's random token in a file name


def _state(step: int) -> dict[str, Any]:
    """A 64 KiB and a 1 KiB frozen tensor (the service's default threshold is 64 KiB), and
    a 64 KiB tensor that changes every step."""
    frozen = torch.Generator().manual_seed(1)
    return {
        "model": {
            "big": torch.randn(128, 128, generator=frozen),
            "small": torch.randn(16, 16, generator=frozen),
            "moving": torch.randn(128, 128, generator=torch.Generator().manual_seed(100 + step)),
        }
    }


def _layout(root: Path, step: int) -> dict[str, Any]:
    """What a step stores, tokens left out: its files (path, size), its blob entries and
    each component's blob references."""
    manifest = msgspec.json.decode((root / f"{step:012d}" / "manifest.json").read_bytes())
    return {
        "files": sorted((_TOKEN.sub(".", f["path"]), f["size"]) for f in manifest["files"]),
        "blobs": sorted((b["name"], b["size"], b["written"]) for b in manifest["blobs"]),
        "refs": {n: c.get("refs", {}) for n, c in manifest["components"].items()},
    }


@pytest.mark.parametrize(("least", "blobs"), [(2**20, set()), (1024, {"big", "small", "moving"})])
def test_the_trainers_incremental_threshold_decides_blobs_through_the_service(
    least: int, blobs: set[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with running_service() as service:
        monkeypatch.setattr(tunables, "INCREMENTAL_MIN_BYTES", least)  # this trainer's only
        for name, where in (("inproc", None), ("svc", service.socket)):
            with checkpointd.CheckpointWriter(
                str(tmp_path / name), incremental=True, service=where
            ) as writer:
                for step in (1, 2):
                    writer.save(step, _state(step)).result(60)
    for step in (1, 2):
        inproc, svc = _layout(tmp_path / "inproc", step), _layout(tmp_path / "svc", step)
        assert svc == inproc
        assert set(svc["refs"]["model"]) == blobs
        assert files_by_component(tmp_path / "svc", step) == files_by_component(
            tmp_path / "inproc", step
        )
    blob_files = {p.name for p in (tmp_path / "svc" / "blobs").glob("*") if p.is_file()}
    assert blob_files == {p.name for p in (tmp_path / "inproc" / "blobs").glob("*") if p.is_file()}


def _same_through_both(root: Path, *, steps: tuple[int, ...] = (1,)) -> None:
    """Each step under ``root``/svc stores the very files of ``root``/inproc (byte for byte,
    tokens left out of the names)."""
    for step in steps:
        svc, inproc = root / "svc", root / "inproc"
        assert _layout(svc, step) == _layout(inproc, step)
        assert files_by_component(svc, step) == files_by_component(inproc, step)


def _data_start(root: Path, step: int) -> int:
    """Where the data region of step's one tensor file starts (its header's end)."""
    (data,) = (v for k, v in files_by_component(root, step).items() if ".tensors" in k)
    return 8 + int.from_bytes(data[:8], "little")


@pytest.mark.parametrize(("least", "aligned"), [(1, True), (2**40, False)])
def test_the_trainers_direct_io_threshold_decides_alignment_through_the_service(
    least: int, aligned: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DIRECT_MIN_BYTES of 1: every data region starts 4 KiB-aligned; of 1 TiB: none does
    (the service's own is 1 MiB, the state's 68 KiB region between the two)."""
    with running_service() as service:
        monkeypatch.setattr(tunables, "DIRECT_MIN_BYTES", least)  # this trainer's only
        for name, where in (("inproc", None), ("svc", service.socket)):
            with checkpointd.CheckpointWriter(str(tmp_path / name), service=where) as writer:
                writer.save(1, _state(1)).result(60)
    _same_through_both(tmp_path)
    assert (_data_start(tmp_path / "svc", 1) % DIRECT_ALIGN == 0) is aligned


def test_the_layout_is_fixed_when_the_writer_is_made_in_both_backends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tunables changed after the writers were made apply to neither: the saves are laid
    out (alignment, blobs) as the tunables were when the writers were made."""
    monkeypatch.setattr(tunables, "INCREMENTAL_MIN_BYTES", 2**30)  # no blob at all
    monkeypatch.setattr(tunables, "DIRECT_MIN_BYTES", 2**40)  # no region aligned
    with running_service() as service, contextlib.ExitStack() as stack:
        writers = [
            stack.enter_context(
                checkpointd.CheckpointWriter(str(tmp_path / name), incremental=True, service=where)
            )
            for name, where in (("inproc", None), ("svc", service.socket))
        ]
        monkeypatch.setattr(tunables, "INCREMENTAL_MIN_BYTES", 1)
        monkeypatch.setattr(tunables, "DIRECT_MIN_BYTES", 1)
        for writer in writers:
            for step in (1, 2):
                writer.save(step, _state(step)).result(60)
    _same_through_both(tmp_path, steps=(1, 2))
    for step in (1, 2):
        assert _layout(tmp_path / "svc", step)["refs"]["model"] == {}
    assert _data_start(tmp_path / "svc", 1) % DIRECT_ALIGN != 0


@pytest.mark.parametrize("service_too", [False, True])
def test_a_layout_tunable_out_of_range_is_refused_when_the_writer_is_made(
    service_too: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with running_service() as service:
        monkeypatch.setattr(tunables, "SHARD_BLOCK_BYTES", 0)
        where = service.socket if service_too else None
        with pytest.raises(InvalidArgumentError, match="shard block size 0"):
            checkpointd.CheckpointWriter(str(tmp_path), service=where)
    assert not list(tmp_path.iterdir())


@pytest.mark.timeout(300)
def test_the_trainers_shard_block_and_index_threshold_through_the_services(
    tmp_path: Path,
) -> None:
    """A 2-rank FSDP2 job (tests/support/shard_job.py) with shard blocks of BLOCK bytes
    and SHARD_INDEX_MIN_ENTRIES of 0 (the services keep their defaults): through a
    service per rank it stores the files an in-process save stores, shard index files
    included, and every shard in blocks of BLOCK bytes."""
    from tests.integration.test_service_sharded import _saved_both_ways, _token_free
    from tests.integration.test_sharded import BLOCK

    assert tunables.SHARD_INDEX_MIN_ENTRIES > 0

    def token_free(root: Path) -> tuple[dict[str, Any], dict[str, bytes]]:
        """As ``_token_free``, the token also out of the index files' text (it names the
        shard files there), so their CRC32Cs are left out of the manifest."""
        manifest, files = _token_free(root, 1)
        (token,) = {p.name.split(".")[1] for p in (root / "000000000001").glob("shards.*")}
        for entry in manifest["files"]:
            if entry["path"].startswith("shards."):
                del entry["crc32c"]
        indexes = {
            n: d.replace(token.encode(), b"TOKEN") for n, d in files.items() if "shards." in n
        }
        return manifest, files | indexes

    svc, _, local = _saved_both_ways(tmp_path, CHECKPOINTD_TEST_SHARD_INDEX="1")
    svc_manifest, svc_files = token_free(svc)
    local_manifest, local_files = token_free(local)
    assert svc_manifest == local_manifest
    assert svc_files == local_files
    indexes = sorted(n for n in svc_files if n.startswith("shards."))
    assert indexes == ["shards.TOKEN.rank0.json", "shards.TOKEN.rank1.json"]
    blocks = {
        shard["block_bytes"]
        for name in indexes
        for tensors in msgspec.json.decode(svc_files[name])["components"].values()
        for shards in tensors.values()
        for shard in shards
    }
    assert blocks == {BLOCK}
