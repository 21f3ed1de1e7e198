"""``checkpointd export``: one component of a checkpoint as a .safetensors or .pt file.

Blocking; call from any thread. The file appears complete or not at all
(written beside the target, then renamed over it).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from checkpointd.restore import load
from checkpointd.tree import alias_key, flatten

__all__ = ["Export", "export_component", "save_safetensors"]


@dataclass(frozen=True, slots=True)
class Export:
    """What ``export_component`` wrote: the step, how many tensors (or -1 for a whole
    tree), how many non-tensor leaves were left out, and the file's size."""

    step: int
    tensors: int
    skipped: int
    nbytes: int


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: str) -> None:
    """Write ``tensors`` to ``path`` with ``safetensors.torch.save_file``.

    save_file writes straight from each tensor's memory (no copy for contiguous
    CPU tensors) but refuses two names over the same memory, so an aliased
    tensor (tied weights) is copied once per extra name, as separate entries.
    """
    from safetensors.torch import save_file

    plain: dict[str, torch.Tensor] = {}
    seen: set[tuple[Any, ...]] = set()
    for name, tensor in tensors.items():
        value = tensor.detach().cpu().contiguous()
        key = alias_key(value)
        plain[name] = value.clone() if key in seen else value
        seen.add(key)
    save_file(plain, path)


def export_component(
    root: str,
    component: str,
    target: str,
    *,
    step: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Export:
    """Write ``component`` of ``step`` (default: the newest) to ``target``.

    ``target`` ending in .safetensors: every tensor and array of the tree under
    its dotted path (ValueError if two paths give the same name); .pt:
    ``torch.save`` of the whole tree. Any other suffix is a ValueError.
    """
    kind = os.path.splitext(target)[1].lower()
    if kind not in (".safetensors", ".pt"):
        raise ValueError(f"--to {target}: the file name must end in .safetensors or .pt")
    checkpoint = load(root, step, components=[component], storage_options=storage_options)
    tree = checkpoint.state[component]
    folder = os.path.dirname(os.path.abspath(target))
    temp = os.path.join(folder, f".{os.path.basename(target)}.tmp-{os.getpid()}")
    try:
        if kind == ".safetensors":
            tensors, skipped = flatten(tree)
            save_safetensors(tensors, temp)
            count = len(tensors)
        else:
            torch.save(tree, temp)
            count, skipped = -1, 0
        nbytes = os.path.getsize(temp)
        os.replace(temp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
    return Export(checkpoint.info.step, count, skipped, nbytes)
