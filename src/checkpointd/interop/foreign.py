"""Foreign checkpoints in: ``checkpointd import`` and ``import_checkpoint``.

Sources, recognised by what they are (never by running them):

- a ``torch.save`` file (``.pt``, ``.pth``, Lightning ``.ckpt``): read with
  ``torch.load(weights_only=True)`` only;
- a ``.safetensors`` file, or a Hugging Face folder with
  ``model.safetensors.index.json`` (or one ``model.safetensors``);
- a PyTorch DCP folder: its ``.metadata`` pickle is read by ``DCPUnpickler``,
  which admits only DCP's own metadata classes, torch sizes/dtypes/layouts and
  plain containers; its tensors by ``torch.load(weights_only=True)``.

Blocking; call from any thread (not while a writer on ROOT runs in this thread).
"""

from __future__ import annotations

import errno
import json
import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from checkpointd.errors import (
    CheckpointError,
    CorruptCheckpointError,
    InvalidArgumentError,
    StorageNotFoundError,
)
from checkpointd.format.layout import is_component_name
from checkpointd.interop.dcp import DCP_METADATA, DCPUnpickler, brief, read_dcp
from checkpointd.storage.base import translate_os_error

__all__ = ["DCPUnpickler", "ImportResult", "import_checkpoint", "read_source"]

HF_INDEX = "model.safetensors.index.json"


_STORAGE_ERRNOS = frozenset({errno.ENOENT, errno.EACCES, errno.EPERM, errno.EIO})


def _unreadable(exc: Exception, path: str, what: str) -> CheckpointError:
    """StorageError for an I/O failure of the disk, CorruptCheckpointError for the rest.

    A reader's OSError such as EINVAL from seeking past a truncated end is damage.
    """
    if isinstance(exc, OSError) and exc.errno in _STORAGE_ERRNOS:
        return translate_os_error(exc, "read", path)
    return CorruptCheckpointError(f"{path}: not a readable {what} ({brief(exc)})")


def _read_safetensors(path: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    try:
        return dict(load_file(path))
    except Exception as exc:  # SafetensorError, or torch refusing what it describes
        raise _unreadable(exc, path, "safetensors file") from exc


def _read_hf(folder: str) -> dict[str, Any]:
    index = os.path.join(folder, HF_INDEX)
    if not os.path.lexists(index):
        return _read_safetensors(os.path.join(folder, "model.safetensors"))
    try:
        with open(index, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:  # ValueError: not JSON, not UTF-8
        raise _unreadable(exc, index, "JSON index") from exc
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise CorruptCheckpointError(f"{index}: not an object with a weight_map object")
    for shard in weight_map.values():
        if not isinstance(shard, str) or os.path.basename(shard) != shard or shard.startswith("."):
            raise CorruptCheckpointError(f"{index}: unsafe shard name {shard!r}")
    tensors: dict[str, Any] = {}
    for shard in sorted(set(weight_map.values())):
        if not os.path.lexists(os.path.join(folder, shard)):
            raise CorruptCheckpointError(f"{index}: shard {shard!r} is missing")
        tensors.update(_read_safetensors(os.path.join(folder, shard)))
    missing = set(weight_map) - set(tensors)
    if missing:
        raise CorruptCheckpointError(f"{index}: tensors missing from shards: {sorted(missing)[:5]}")
    return {name: tensors[name] for name in weight_map}


def _read_torch(path: str) -> Any:
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CorruptCheckpointError(
            f"{path}: not loadable with torch.load(weights_only=True) ({brief(exc)}); "
            "checkpointd never runs a full unpickle"
        ) from exc
    except Exception as exc:  # truncated or damaged zip, bad storage records
        raise _unreadable(exc, path, "torch.save file") from exc


def read_source(source: str) -> tuple[str, Any]:
    """(kind, object) read from ``source``: ``dcp``, ``hf``, ``safetensors`` or ``torch``.

    A damaged source is CorruptCheckpointError, a missing one StorageNotFoundError.
    """
    if not os.path.lexists(source):
        raise StorageNotFoundError(errno.ENOENT, f"{source}: no such file or folder")
    if os.path.isdir(source):
        if os.path.lexists(os.path.join(source, DCP_METADATA)):
            return "dcp", read_dcp(source)
        if os.path.lexists(os.path.join(source, HF_INDEX)) or os.path.lexists(
            os.path.join(source, "model.safetensors")
        ):
            return "hf", _read_hf(source)
        raise InvalidArgumentError(
            f"{source}: a folder with neither {DCP_METADATA} (DCP) nor {HF_INDEX} / "
            "model.safetensors (Hugging Face)"
        )
    if source.endswith(".safetensors"):
        return "safetensors", _read_safetensors(source)
    return "torch", _read_torch(source)


def _is_lightning(value: Any) -> bool:
    return isinstance(value, dict) and "state_dict" in value and "global_step" in value


def components_of(
    kind: str, value: Any, component: str | None
) -> tuple[dict[str, Any], int | None]:
    """How a read source becomes components, and the step it names (Lightning)."""
    if component is not None:
        return {component: value}, None
    if kind in ("hf", "safetensors"):
        return {"model": value}, None
    if _is_lightning(value):
        out: dict[str, Any] = {"model": value["state_dict"]}
        for key, base in (("optimizer_states", "optimizer"), ("lr_schedulers", "scheduler")):
            items = value.get(key) or []
            for i, item in enumerate(items):
                out[base if len(items) == 1 else f"{base}{i}"] = item
        rest = {
            k: v
            for k, v in value.items()
            if k not in ("state_dict", "optimizer_states", "lr_schedulers")
        }
        out["lightning"] = rest
        step = value.get("global_step")
        return out, step if isinstance(step, int) else None
    if (
        isinstance(value, dict)
        and value
        and all(is_component_name(k) and isinstance(v, Mapping) for k, v in value.items())
    ):
        return dict(value), None
    return {"model": value}, None


@dataclass(frozen=True, slots=True)
class ImportResult:
    """What ``import_checkpoint`` wrote: the source kind, the step and the components."""

    kind: str
    step: int
    components: tuple[str, ...]


def import_checkpoint(
    source: str,
    root: str,
    *,
    step: int | None = None,
    component: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> ImportResult:
    """Read a foreign checkpoint and commit it as one checkpointd checkpoint under ``root``.

    Without ``component`` the source's parts become components: HF/safetensors ->
    ``model``; Lightning -> ``model``, ``optimizer``, ``scheduler``, ``lightning``; a
    dict of str-keyed dicts -> one component per key; anything else -> ``model``.
    Blocking.

    Args:
        source: A ``torch.save`` file, a ``.safetensors`` file, a Hugging Face model
            folder or a PyTorch DCP folder.
        root: The checkpointd root to commit into (a local path or fsspec URL).
        step: The step to commit as; None: a Lightning file's ``global_step``, else 0.
        component: Put the whole source in one component of this name.
        storage_options: fsspec options for ``root``.

    Returns:
        What was written: the source's kind, the step and the components.

    Raises:
        InvalidArgumentError: ``component`` is not a valid name, or the source's kind
            is not recognised.
        StorageNotFoundError: ``source`` does not exist.
        CorruptCheckpointError: The source cannot be read as what it claims to be.
        CheckpointExistsError: ``step`` is already committed under ``root``.
        StorageError: Writing to ``root`` failed.
    """
    if component is not None and not is_component_name(component):
        raise InvalidArgumentError(f"component name {component!r} is not valid")
    kind, value = read_source(os.fspath(source))
    components, named_step = components_of(kind, value, component)
    found = step if step is not None else named_step if named_step is not None else 0
    from checkpointd.api.writer import CheckpointWriter

    with CheckpointWriter(root, storage_options=storage_options) as writer:
        writer.save(found, components).result()
    return ImportResult(kind, found, tuple(components))
