"""Where a checkpoint's files are: their names carry a per-save token, so ask the manifest."""

from __future__ import annotations

from typing import Any, Literal

from checkpointd.read.catalog import read_manifest
from checkpointd.storage import open_store


def component_file(
    root: str,
    step: int,
    component: str,
    kind: Literal["tensors", "tree"] = "tensors",
    storage_options: dict[str, Any] | None = None,
) -> str:
    """The name (inside the step folder) of ``component``'s tensor or tree file at ``step``."""
    store = open_store(root, storage_options)
    try:
        entry = read_manifest(store, step).components[component]
    finally:
        store.close()
    return entry.tree if kind == "tree" else entry.tensors[0]
