"""GCS and Azure Blob backends through the public API and the command line, against
emulators the tests start themselves: fake-gcs-server (honours ifGenerationMatch=0),
gcp-storage-emulator (ignores it: the probe warns and publish falls back to the
guarded path) and Azurite (honours If-None-Match: *)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch

import checkpointd
from checkpointd.cli.main import main
from checkpointd.errors import (
    CheckpointExistsError,
    StorageCapabilityWarning,
    StorageError,
    StorageNotFoundError,
    StoragePermissionError,
)
from checkpointd.storage import open_store
from tests.conftest import Root

CLOUD = ["gcs", "gcsemu", "azure"]
STORE_TYPES = {"gcs": "GCSStore", "gcsemu": "GCSStore", "azure": "AzureStore"}
"""Imported only once the emulator fixture has started (it skips where gcsfs or adlfs
is missing, outside CI)."""


@pytest.fixture(params=CLOUD)
def cloud_root(request: pytest.FixtureRequest) -> Root:
    found: Root = request.getfixturevalue(f"{request.param}_root")
    return found


def _warned(root: Root) -> contextlib.AbstractContextManager[object]:
    """gcp-storage-emulator ignores ifGenerationMatch: its first publish warns."""
    if root.kind == "gcsemu":
        return pytest.warns(StorageCapabilityWarning, match="not exclusive")
    return contextlib.nullcontext()


def _options(root: Root) -> list[str]:
    return [
        f"--storage-option={k}={json.dumps(v)}" for k, v in (root.storage_options or {}).items()
    ]


def test_save_load_restore_verify_and_gc(
    cloud_root: Root, capsys: pytest.CaptureFixture[str]
) -> None:
    root, options = cloud_root, cloud_root.storage_options
    assert type(open_store(root.url, options)).__name__ == STORE_TYPES[root.kind]
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    states: dict[int, dict[str, Any]] = {}
    with _warned(root), checkpointd.CheckpointWriter(root.url, storage_options=options) as writer:
        for step in (1, 2, 3):
            model(torch.randn(2, 8)).sum().backward()
            optimizer.step()
            states[step] = {k: v.clone() for k, v in model.state_dict().items()}
            writer.save(step, {"model": model, "optimizer": optimizer, "extra": {"step": step}})
    assert [c.step for c in checkpointd.list_checkpoints(root.url, storage_options=options)] == [
        1,
        2,
        3,
    ]
    loaded = checkpointd.load(root.url, storage_options=options)
    assert loaded.info.step == 3
    assert loaded.state["extra"] == {"step": 3}
    for name, value in states[3].items():
        assert torch.equal(loaded.state["model"][name], value)
    fresh = torch.nn.Linear(8, 4)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    checkpointd.restore(
        root.url,
        {"model": fresh, "optimizer": fresh_opt},
        step=2,
        storage_options=options,
        strict=False,
    )
    for name, value in states[2].items():
        assert torch.equal(fresh.state_dict()[name], value)
    momentum = fresh_opt.state_dict()["state"][0]["momentum_buffer"]
    assert momentum.abs().sum() > 0

    capsys.readouterr()
    assert main(["verify", root.url, "--all", *_options(root)]) == 0
    assert main(["gc", root.url, "--keep-last", "1", "--apply", *_options(root)]) == 0
    assert "deleted 2 checkpoint(s)" in capsys.readouterr().out
    assert [c.step for c in checkpointd.list_checkpoints(root.url, storage_options=options)] == [3]
    store = open_store(root.url, options)
    assert store.list_dir("") == [f"{3:012d}"], "gc or the probe left something behind"


def test_a_second_writer_never_overwrites_a_committed_step(cloud_root: Root) -> None:
    root, options = cloud_root, cloud_root.storage_options
    with _warned(root), checkpointd.CheckpointWriter(root.url, storage_options=options) as w:
        w.save(5, {"x": torch.ones(3)}).result(timeout=60)
    with warnings.catch_warnings():  # it may stop at the step check, before any publish
        warnings.simplefilter("ignore", StorageCapabilityWarning)
        with (
            checkpointd.CheckpointWriter(root.url, storage_options=options) as other,
            pytest.raises(CheckpointExistsError),
        ):
            other.save(5, {"x": torch.zeros(3)}).result(timeout=60)
    assert torch.equal(
        checkpointd.load(root.url, storage_options=options).state["x"], torch.ones(3)
    )


def test_the_probe_tells_honouring_from_ignoring_servers(cloud_root: Root) -> None:
    store = open_store(cloud_root.url, cloud_root.storage_options)
    assert store.capabilities.exclusive_create is None  # not asked yet
    assert store.exclusive_create is (cloud_root.kind != "gcsemu")
    assert store.capabilities.exclusive_create is (cloud_root.kind != "gcsemu")


def test_a_missing_bucket_or_container_is_not_found_and_never_created(cloud_root: Root) -> None:
    container = cloud_root.url.split("://", 1)[1].split("/", 1)[0]
    missing = cloud_root.url.replace(container, "no-such-bucket-here")
    with pytest.raises(StorageNotFoundError, match="never creates"):
        open_store(missing, cloud_root.storage_options)
    with pytest.raises(StorageNotFoundError, match="never creates"):
        open_store(missing, cloud_root.storage_options)  # still missing: not created


def test_importing_the_storage_package_imports_no_cloud_client() -> None:
    code = (
        "import sys, checkpointd.storage as s\n"
        "assert s._BUILT_IN['gs'] and s._BUILT_IN['az']\n"
        "loaded = sorted(m for m in ('gcsfs', 'adlfs', 'azure', 'fsspec') if m in sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_backend_errors_leave_as_storage_errors_and_bugs_pass_through(
    cloud_root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(cloud_root.url, cloud_root.storage_options)
    if cloud_root.kind.startswith("gcs"):
        import gcsfs.retry

        denied: BaseException = OSError("Forbidden: b/x/o\nno access")
        other: BaseException = gcsfs.retry.HttpError({"code": 503, "message": "busy"})
    else:
        import azure.core.exceptions as azure_errors

        denied = azure_errors.ClientAuthenticationError("bad key")
        other = azure_errors.ServiceRequestError("connection reset")
    for raised, expected in (
        (denied, StoragePermissionError),
        (other, StorageError),
        (KeyError("a bug"), KeyError),
    ):

        def fail(*args: object, raised: BaseException = raised, **kwargs: object) -> bytes:
            raise raised

        monkeypatch.setattr(store.fs, "cat_file", fail)
        with pytest.raises(expected):
            store.read_bytes("x", 0, 1)
    monkeypatch.undo()
    with pytest.raises(StorageNotFoundError):
        store.read_bytes("missing", 0, 1)
