"""A checkpoint deleted between the reader's size check and its read.

Retention removes the manifest first, then the folder: a reader that loses a
file of a step whose manifest is gone too gets CheckpointNotFoundError (the
step was deleted), one whose manifest is still there CorruptCheckpointError.
Deterministic: the store deletes right before the first data read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import checkpointd
from checkpointd.errors import CheckpointNotFoundError, CorruptCheckpointError
from checkpointd.format.manifest import MANIFEST_NAME, step_dirname
from checkpointd.storage import FsspecStore, LocalStore, Store
from tests.conftest import Root

FOLDER = step_dirname(1)


def _save(root: Root, numel: int) -> torch.Tensor:
    weights = torch.arange(numel, dtype=torch.float32)
    with checkpointd.CheckpointWriter(root.url, storage_options=root.storage_options) as writer:
        writer.save(1, {"m": {"w": weights}}).result(timeout=60)
    return weights


def _delete_before_first_data_read(
    monkeypatch: pytest.MonkeyPatch, cls: type[Store], method: str, whole_step: bool
) -> list[str]:
    """Patch ``cls.method`` to delete (like retention) before the first non-manifest read."""
    original: Callable[..., Any] = getattr(cls, method)
    deleted: list[str] = []

    def patched(self: Store, path: str, *args: Any) -> Any:
        if not deleted and not path.endswith(MANIFEST_NAME):
            deleted.append(path)
            if whole_step:
                self.remove_file(f"{FOLDER}/{MANIFEST_NAME}")  # retention's order
                self.remove_dir(FOLDER)
            else:
                self.remove_file(path)
        return original(self, path, *args)

    monkeypatch.setattr(cls, method, patched)
    return deleted


# (backend, tensor elements, patched class and method): a small file and a 2 MiB one.
CASES = {
    "local-read": ("local", 16, LocalStore, "read_into"),
    "local-large": ("local", 2**19, LocalStore, "read_into"),
    "memory-read": ("memory", 16, FsspecStore, "read_into"),
}


def _provoke(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, case: str, whole_step: bool
) -> tuple[Root, int, list[str]]:
    """Save one step on the case's backend and arm the deletion; returns (root, numel, log)."""
    backend, numel, cls, method = CASES[case]
    root: Root = request.getfixturevalue(f"{backend}_root")
    _save(root, numel)
    return root, numel, _delete_before_first_data_read(monkeypatch, cls, method, whole_step)


def _read(root: Root, numel: int, api: str) -> None:
    if api == "load":
        checkpointd.load(root.url, storage_options=root.storage_options)
    else:
        target = {"w": torch.zeros(numel)}
        checkpointd.restore(root.url, {"m": target}, storage_options=root.storage_options)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("api", ["load", "restore"])
def test_step_deleted_mid_read_is_not_found(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, case: str, api: str
) -> None:
    root, numel, deleted = _provoke(request, monkeypatch, case, whole_step=True)
    with pytest.raises(CheckpointNotFoundError, match=r"step 1 .*was deleted while"):
        _read(root, numel, api)
    assert deleted, "the race was not provoked"


@pytest.mark.parametrize("case", CASES)
def test_file_missing_from_a_committed_step_is_corrupt(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    root, numel, deleted = _provoke(request, monkeypatch, case, whole_step=False)
    with pytest.raises(CorruptCheckpointError, match="missing"):
        _read(root, numel, "load")
    assert deleted, "the race was not provoked"
