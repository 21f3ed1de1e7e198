"""Reading checkpoints back: list, load into plain trees, restore into live objects.

Blocking; call from any thread. Loading never runs code (no pickle), never
reads outside the root, and checks each file's size (and, with ``verify``, its
CRC32C) before parsing a byte of it.
"""

from __future__ import annotations

import concurrent.futures
import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from checkpointd import catalog
from checkpointd.checksum import crc32c
from checkpointd.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    RestoreMismatchError,
    StorageNotFoundError,
)
from checkpointd.format import decode_tree, header_length, parse_safetensors_header
from checkpointd.manifest import CheckpointInfo, ComponentEntry, FileEntry, Manifest, step_dirname
from checkpointd.stateful import check_restorable, component_state, load_component, unwrap
from checkpointd.storage import Store, open_store

__all__ = ["Checkpoint", "list_checkpoints", "load", "restore"]

_READ_THREADS = 4


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A loaded checkpoint: ``info`` and ``state[component]`` (its state tree)."""

    info: CheckpointInfo
    state: dict[str, Any]


def list_checkpoints(
    root: str, *, storage_options: Mapping[str, Any] | None = None
) -> list[CheckpointInfo]:
    """Every committed checkpoint under ``root``, ascending by step."""
    store = open_store(str(root), storage_options)
    try:
        return catalog.infos(store)
    finally:
        store.close()


def _resolve_step(store: Store, step: int | None) -> tuple[int, Manifest]:
    if step is not None:
        return step, catalog.read_manifest(store, step)
    newest = catalog.committed(store, newest_first=True)
    if not newest:
        raise CheckpointNotFoundError(
            f"no committed checkpoint under {store.url}; save one first or check the path"
        )
    return newest[0]


class _Reader:
    """Reads and checks the files of one committed step."""

    def __init__(self, store: Store, step: int, manifest: Manifest, verify: bool) -> None:
        self.store = store
        self.folder = step_dirname(step)
        self.where = catalog.step_path(store, step)
        self.files: dict[str, FileEntry] = {f.path: f for f in manifest.files}
        self.verify = verify

    def read(self, name: str) -> torch.Tensor:
        """The whole file as a uint8 tensor, after the size and digest checks."""
        entry = self.files[name]
        path = f"{self.folder}/{name}"
        try:
            size = self.store.size(path)
        except StorageNotFoundError:
            raise CorruptCheckpointError(
                f"{self.where}/{name}: listed in manifest but missing"
            ) from None
        if size != entry.size:
            raise CorruptCheckpointError(
                f"{self.where}/{name}: size {size} does not match the manifest's {entry.size}"
            )
        data = torch.empty(size, dtype=torch.uint8)
        view = data.numpy().data.cast("B")
        self.store.read_into(path, view)
        if self.verify:
            actual = crc32c(view)
            if actual != entry.crc32c:
                raise CorruptCheckpointError(
                    f"{self.where}/{name}: CRC32C {actual:08x} does not match the "
                    f"manifest's {entry.crc32c:08x}"
                )
        return data

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """Every tensor of a tensor file, as views of one buffer read in a single pass."""
        data = self.read(name)
        where = f"{self.where}/{name}"
        raw = bytes(data[:8].numpy())
        length = header_length(raw, data.numel(), where=where)
        start = 8 + length
        entries = parse_safetensors_header(
            bytes(data[8:start].numpy()), data.numel() - start, where=where
        )
        tensors: dict[str, torch.Tensor] = {}
        for entry in entries:
            chunk = data[start + entry.begin : start + entry.end]
            if (start + entry.begin) % entry.dtype.itemsize:
                chunk = chunk.clone()  # misaligned for this dtype: copy to an aligned buffer
            tensors[entry.name] = chunk.view(entry.dtype).view(entry.shape)
        return tensors

    def component(self, name: str, entry: ComponentEntry) -> Any:
        tensors: dict[str, torch.Tensor] = {}
        for tensor_file in entry.tensors:
            tensors.update(self.tensors(tensor_file))
        tree = bytes(self.read(entry.tree).numpy())
        return decode_tree(tree, tensors, where=f"{self.where}/{entry.tree}")


def _move(tree: Any, device: torch.device) -> Any:
    """Move every tensor of a tree to ``device``, keeping aliased tensors aliased."""
    moved: dict[int, torch.Tensor] = {}

    def visit(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) not in moved:
                moved[id(value)] = value.to(device)
            return moved[id(value)]
        if isinstance(value, dict):
            result = type(value)((k, visit(v)) for k, v in value.items())
            if hasattr(value, "_metadata"):
                result._metadata = value._metadata  # type: ignore[attr-defined]
            return result
        if isinstance(value, list):
            return [visit(v) for v in value]
        if isinstance(value, tuple):
            return tuple(visit(v) for v in value)
        return value

    return visit(tree)


def load(
    root: str,
    step: int | None = None,
    *,
    components: Iterable[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    map_location: str | torch.device | None = None,
    verify: bool = True,
) -> Checkpoint:
    """Load the newest committed checkpoint (or ``step``): all components or the named ones.

    Tensors come back on CPU, or on ``map_location``. Raises CheckpointNotFoundError
    if nothing (or not that step, or not that component) is committed, and
    CorruptCheckpointError if a size, digest or header check fails.
    """
    store = open_store(str(root), storage_options)
    try:
        found_step, manifest = _resolve_step(store, step)
        wanted = list(manifest.components) if components is None else list(components)
        missing = [name for name in wanted if name not in manifest.components]
        if missing:
            raise CheckpointNotFoundError(
                f"step {found_step} has no component {', '.join(map(repr, missing))} "
                f"(it has: {', '.join(manifest.components)})"
            )
        reader = _Reader(store, found_step, manifest, verify)
        with concurrent.futures.ThreadPoolExecutor(_READ_THREADS) as pool:
            futures = {n: pool.submit(reader.component, n, manifest.components[n]) for n in wanted}
            state = {name: future.result() for name, future in futures.items()}
        if map_location is not None:
            device = torch.device(map_location)
            state = {name: _move(tree, device) for name, tree in state.items()}
        info = CheckpointInfo.from_manifest(manifest, catalog.step_path(store, found_step))
        return Checkpoint(info, state)
    finally:
        store.close()


def _tensor_shapes(tree: Any, prefix: str = "") -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Path -> (shape, dtype) of every tensor in a module-style flat state dict."""
    if not isinstance(tree, Mapping):
        return {}
    return {
        f"{prefix}{k}": (tuple(v.shape), v.dtype)
        for k, v in tree.items()
        if isinstance(v, torch.Tensor)
    }


def _check_fits(name: str, target: Any, tree: Any) -> None:
    """Raise RestoreMismatchError if a module's tensors differ in names, shapes or dtypes."""
    live = unwrap(target)
    if not isinstance(live, torch.nn.Module):
        return
    expected = _tensor_shapes(live.state_dict())
    stored = _tensor_shapes(tree)
    problems: list[str] = []
    if missing := sorted(expected.keys() - stored.keys()):
        problems.append(f"missing {missing[:5]}")
    if unexpected := sorted(stored.keys() - expected.keys()):
        problems.append(f"unexpected {unexpected[:5]}")
    for key in sorted(expected.keys() & stored.keys()):
        if expected[key] != stored[key]:
            problems.append(
                f"{key}: stored {list(stored[key][0])} {stored[key][1]}, "
                f"live {list(expected[key][0])} {expected[key][1]}"
            )
    if problems:
        raise RestoreMismatchError(
            f"component {name!r} does not fit its target: {'; '.join(problems[:8])}"
        )


def _backup(target: Any) -> Any:
    """A deep copy of a target's current state, to roll back a failed restore."""
    state = component_state(target, "backup")
    return copy.deepcopy(state)


def restore(
    root: str,
    targets: Mapping[str, Any],
    step: int | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
    strict: bool = True,
) -> CheckpointInfo:
    """Load a checkpoint and ``load_state_dict`` it into the live ``targets``, all or nothing.

    Everything is read and checked before any target changes; if a target still
    rejects its state, the targets already restored are rolled back. With
    ``strict``, every target needs a component and every component a target.
    """
    store = open_store(str(root), storage_options)
    try:
        found_step, manifest = _resolve_step(store, step)
    finally:
        store.close()
    names = [n for n in targets if n in manifest.components]
    if strict:
        missing = sorted(set(targets) - set(manifest.components))
        unexpected = sorted(set(manifest.components) - set(targets))
        if missing or unexpected:
            raise RestoreMismatchError(
                f"step {found_step}: targets without a component: {missing or 'none'}; "
                f"components without a target: {unexpected or 'none'} "
                "(pass strict=False to restore the intersection)"
            )
    for name in names:
        check_restorable(targets[name], name)
    checkpoint = load(root, found_step, components=names, storage_options=storage_options)
    for name in names:
        _check_fits(name, targets[name], checkpoint.state[name])
    backups = {name: _backup(targets[name]) for name in names}
    restored: list[str] = []
    try:
        for name in names:
            load_component(targets[name], checkpoint.state[name])
            restored.append(name)
    except Exception as exc:
        # The failing target may be half-loaded too (Module.load_state_dict copies before raising).
        for undo in [*restored, name]:
            load_component(targets[undo], backups[undo])
        raise RestoreMismatchError(
            f"component {name!r} was rejected by its target ({exc}); nothing was changed"
        ) from exc
    return checkpoint.info
