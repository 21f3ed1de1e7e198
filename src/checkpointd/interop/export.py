"""``checkpointd export``: one component of a checkpoint as a .safetensors or .pt file,
a Hugging Face sharded safetensors folder, or a PyTorch DCP folder.

Blocking; call from any thread. The file or folder appears complete or not at
all (written beside the target, then renamed onto it).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from checkpointd import tunables
from checkpointd.errors import InvalidArgumentError
from checkpointd.read.restore import load
from checkpointd.state.tree import alias_key, flatten

__all__ = ["Export", "export_component", "export_dcp", "export_hf", "save_safetensors"]


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
    ``torch.save`` of the whole tree. Any other suffix is an InvalidArgumentError.
    """
    kind = os.path.splitext(target)[1].lower()
    if kind not in (".safetensors", ".pt"):
        raise InvalidArgumentError(f"--to {target}: the file name must end in .safetensors or .pt")
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


def _fresh_folder(target: str) -> str:
    """A temporary folder beside ``target`` (which must not exist yet)."""
    if os.path.exists(target):
        raise InvalidArgumentError(f"--to {target}: already exists; export writes a new folder")
    parent = os.path.dirname(os.path.abspath(target)) or "."
    os.makedirs(parent, exist_ok=True)
    temp = os.path.join(parent, f".{os.path.basename(target)}.tmp-{os.getpid()}")
    shutil.rmtree(temp, ignore_errors=True)
    os.mkdir(temp)
    return temp


def export_hf(
    root: str,
    component: str,
    target: str,
    *,
    step: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    shard_bytes: int = tunables.DEFAULT_EXPORT_SHARD_BYTES,
) -> Export:
    """Write ``component``'s tensors as a Hugging Face folder: safetensors shards of at
    most ``shard_bytes`` (a larger tensor gets its own) and ``model.safetensors.index.json``."""
    checkpoint = load(root, step, components=[component], storage_options=storage_options)
    tensors, skipped = flatten(checkpoint.state[component])
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    temp = _fresh_folder(target)
    try:
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_safetensors(shard, os.path.join(temp, file))
            weight_map.update(dict.fromkeys(shard, file))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(temp, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
        nbytes = sum(os.path.getsize(os.path.join(temp, n)) for n in os.listdir(temp))
        os.rename(temp, target)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return Export(checkpoint.info.step, len(tensors), skipped, nbytes)


def export_dcp(
    root: str,
    target: str,
    *,
    components: Iterable[str] | None = None,
    step: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Export:
    """Write the checkpoint (or the named components) as a PyTorch DCP folder that
    ``torch.distributed.checkpoint.load`` reads in one process; keys are component names,
    plus ``checkpointd.empty_mappings`` (the paths of empty dicts) if there are any."""
    import warnings

    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from checkpointd.interop.dcp import EMPTY_MAPPINGS, empty_mappings

    checkpoint = load(root, step, components=components, storage_options=storage_options)
    state = dict(checkpoint.state)
    empties = empty_mappings(state)
    if empties:  # DCP's flattening drops empty dicts; import puts them back
        state[EMPTY_MAPPINGS] = empties
    temp = _fresh_folder(target)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_save(state, checkpoint_id=temp, no_dist=True)
        nbytes = sum(os.path.getsize(os.path.join(temp, n)) for n in os.listdir(temp))
        os.rename(temp, target)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return Export(checkpoint.info.step, -1, 0, nbytes)
