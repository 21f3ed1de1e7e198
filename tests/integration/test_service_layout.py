"""The tunables that decide a save's files are the trainer's, also through the service:
a trainer that changed INCREMENTAL_MIN_BYTES gets the files an in-process save writes,
not those of the service's own threshold (which is left at its default here)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

import checkpointd
from checkpointd import tunables
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
