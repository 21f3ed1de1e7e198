"""Reading checkpoints back: list, load into plain trees, restore into live objects.

Blocking; call from any thread. Loading never runs code (no pickle), never
reads outside the root, and checks each file's size (and, with ``verify``, its
CRC32C) before parsing a byte of it.
"""

from __future__ import annotations

import concurrent.futures
import copy
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from checkpointd import catalog
from checkpointd.checksum import crc32c
from checkpointd.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    RestoreMismatchError,
    StorageNotFoundError,
)
from checkpointd.format import decode_tree, header_length, parse_safetensors_header
from checkpointd.manifest import (
    MANIFEST_NAME,
    CheckpointInfo,
    ComponentEntry,
    FileEntry,
    Manifest,
    step_dirname,
)
from checkpointd.stateful import (
    check_restorable,
    check_state,
    component_state,
    layout_problems,
    load_component,
    unwrap,
)
from checkpointd.storage import Store, open_store

__all__ = ["Checkpoint", "RestoreInfo", "list_checkpoints", "load", "restore"]

_READ_THREADS = 4
_log = logging.getLogger("checkpointd")


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
        self.step = step
        self.folder = step_dirname(step)
        self.where = catalog.step_path(store, step)
        self.files: dict[str, FileEntry] = {f.path: f for f in manifest.files}
        self.verify = verify

    def read(self, name: str) -> torch.Tensor:
        """The whole file as a uint8 tensor, after the size and digest checks.

        A file that disappears at any point of the read (size, open, map or read)
        is CheckpointNotFoundError if the step's manifest is gone too (retention
        deletes the manifest first), else CorruptCheckpointError.
        """
        entry = self.files[name]
        path = f"{self.folder}/{name}"
        try:
            size = self.store.size(path)
            if size != entry.size:
                raise CorruptCheckpointError(
                    f"{self.where}/{name}: size {size} does not match the manifest's {entry.size}"
                )
            # Read, never mapped: a tensor over a file map would pin a deleted
            # checkpoint's disk space for as long as any object keeps it (an
            # optimizer keeps its state tensors), and on NFS fault with SIGBUS.
            # Measured: no slower than the map for a 600 MB checkpoint here.
            data = torch.empty(size, dtype=torch.uint8)
            view = data.numpy().data.cast("B")
            self.store.read_into(path, view)
        except StorageNotFoundError:
            raise self._vanished(name) from None
        if self.verify:
            actual = crc32c(view)
            if actual != entry.crc32c:
                raise CorruptCheckpointError(
                    f"{self.where}/{name}: CRC32C {actual:08x} does not match the "
                    f"manifest's {entry.crc32c:08x}"
                )
        return data

    def _vanished(self, name: str) -> CheckpointError:
        """The error for a listed file that is not there (any more)."""
        if not self.store.exists(f"{self.folder}/{MANIFEST_NAME}"):
            # Retention (or gc) deleted the checkpoint while we were reading it.
            return CheckpointNotFoundError(
                f"step {self.step} ({self.where}) was deleted while it was being read; "
                "load again to get the newest step"
            )
        return CorruptCheckpointError(f"{self.where}/{name}: listed in manifest but missing")

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


def _map_tree(
    tree: Any,
    on_tensor: Callable[[torch.Tensor], torch.Tensor],
    on_leaf: Callable[[Any], Any] = lambda value: value,
) -> Any:
    """Rebuild a state tree with ``on_tensor`` applied once per distinct tensor object
    (aliased tensors stay aliased) and ``on_leaf`` to every other leaf. Containers
    keep their types where they can, and a module state dict its ``_metadata``."""
    done: dict[int, torch.Tensor] = {}

    def visit(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) not in done:
                done[id(value)] = on_tensor(value)
            return done[id(value)]
        if isinstance(value, dict):
            items = [(k, visit(v)) for k, v in value.items()]
            try:
                result = type(value)(items)
            except TypeError:  # a dict subclass with another constructor (defaultdict)
                result = dict(items)
            if hasattr(value, "_metadata"):
                result._metadata = copy.deepcopy(value._metadata)  # type: ignore[attr-defined]
            return result
        if isinstance(value, list):
            return [visit(v) for v in value]
        if isinstance(value, tuple):
            return tuple(visit(v) for v in value)
        return on_leaf(value)

    return visit(tree)


def _move(tree: Any, device: torch.device) -> Any:
    """Move every tensor of a tree to ``device``, keeping aliased tensors aliased."""
    return _map_tree(tree, lambda tensor: tensor.to(device))


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

    Tensors come back on CPU (in memory the caller owns, never a view of a
    checkpoint file, so deleting the checkpoint frees its space at once), or on
    ``map_location``. Raises CheckpointNotFoundError
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


def _module_problems(live: torch.nn.Module, tree: Any) -> list[str]:
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
    return problems


def _param_state_problems(
    where: str, param: torch.Tensor, stored: Mapping[Any, Any], live: Mapping[Any, Any] | None
) -> list[str]:
    """Check one parameter's stored optimizer state against the live state, else the param."""
    problems: list[str] = []
    for key, value in stored.items():
        if not isinstance(value, torch.Tensor):
            continue
        shape, dtype = tuple(value.shape), value.dtype
        current = live.get(key) if live else None
        if isinstance(current, torch.Tensor):
            if (shape, dtype) != (tuple(current.shape), current.dtype):
                problems.append(
                    f"{where}/{key}: stored {list(shape)} {dtype}, "
                    f"live {list(current.shape)} {current.dtype}"
                )
            continue
        # No live state yet (a fresh optimizer): torch.optim keeps per-parameter buffers
        # shaped like the parameter, or broadcastable to it (Adafactor's row/column
        # factors), in the parameter's dtype; scalars such as "step" are free.
        if value.numel() <= 1 or value.dim() != param.dim():
            continue
        fits = all(s in (1, p) for s, p in zip(shape, param.shape, strict=True))
        if not fits or (value.is_floating_point() and dtype != param.dtype):
            problems.append(
                f"{where}/{key}: stored {list(shape)} {dtype}, "
                f"parameter is {list(param.shape)} {param.dtype}"
            )
    return problems


_FREE_GROUP_KEYS = frozenset(
    {"params", "param_names", "initial_lr"}
    | {"maximize", "foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay"}
)
"""Parameter-group keys a checkpoint may lack: not hyper-parameters (``params``,
``param_names``), added by LR schedulers (``initial_lr``), or flags torch added
over releases and fills in itself when loading an older state."""


def _group_key_problems(
    kind: str, groups: list[Any] | tuple[Any, ...], live_groups: list[dict[str, Any]]
) -> list[str]:
    """The first group whose stored hyper-parameters lack one the live optimizer uses.

    The state dict records no optimizer type, but each group names its algorithm's
    hyper-parameters (AdamW: betas, eps, amsgrad; SGD: momentum, dampening,
    nesterov). ``load_state_dict`` replaces the live groups with the stored ones,
    so a key only the live side has is gone afterwards and ``step()`` fails on it.
    Keys only the checkpoint has (a newer torch's flags, a scheduler's) are ignored.
    """
    for i, (group, live_group) in enumerate(zip(groups, live_groups, strict=True)):
        if not isinstance(group, Mapping):
            return [f"group {i}: stored {type(group).__name__}, not a parameter group"]
        stored, wanted = set(map(str, group)), set(live_group) - _FREE_GROUP_KEYS
        if missing := sorted(wanted - stored):
            others = sorted(stored - set(live_group) - _FREE_GROUP_KEYS)
            instead = f" (it has {others} instead)" if others else ""
            return [
                f"group {i}: the checkpoint lacks hyper-parameter(s) {missing} that {kind} "
                f"uses{instead}; was it saved by another optimizer type?"
            ]
    return []


def _optimizer_problems(live: torch.optim.Optimizer, tree: Any) -> list[str]:
    """Optimizer type (by group hyper-parameter keys), group count, parameters per
    group, and per-parameter state shapes and dtypes."""
    if not isinstance(tree, Mapping) or not {"state", "param_groups"} <= tree.keys():
        return ["not an optimizer state dict (needs 'state' and 'param_groups')"]
    groups, live_groups = tree["param_groups"], live.param_groups
    if not isinstance(groups, list | tuple):
        return [f"param_groups is a {type(groups).__name__}, not a list"]
    if len(groups) != len(live_groups):
        return [f"{len(groups)} parameter group(s) stored, the optimizer has {len(live_groups)}"]
    if problems := _group_key_problems(type(live).__name__, groups, live_groups):
        return problems
    params: dict[Any, torch.Tensor] = {}
    for i, (group, live_group) in enumerate(zip(groups, live_groups, strict=True)):
        ids = list(group.get("params", []))
        if len(ids) != len(live_group["params"]):
            problems.append(
                f"group {i}: {len(ids)} parameter(s) stored, the optimizer has "
                f"{len(live_group['params'])}"
            )
        else:
            params.update(zip(ids, live_group["params"], strict=True))
    if problems or isinstance(live, torch.optim.LBFGS):  # LBFGS keeps flat whole-model state
        return problems
    for pid, stored in tree["state"].items():
        if pid not in params:
            problems.append(f"state for parameter id {pid!r}, which no group lists")
        elif isinstance(stored, Mapping):
            param = params[pid]
            problems += _param_state_problems(f"state/{pid}", param, stored, live.state.get(param))
    return problems


def _scheduler_problems(live: torch.optim.lr_scheduler.LRScheduler, tree: Any) -> list[str]:
    """A different scheduler class, or a different number of parameter groups."""
    if not isinstance(tree, Mapping):
        return ["not a scheduler state dict"]
    current = live.state_dict()
    missing = sorted(map(str, current.keys() - tree.keys()))
    unexpected = sorted(map(str, tree.keys() - current.keys()))
    # Keys come and go between torch versions; both at once means another scheduler class.
    if missing and unexpected:
        return [f"missing keys {missing[:5]}, unexpected keys {unexpected[:5]}"]
    return [
        f"{key}: {len(tree[key])} stored, {len(value)} live"
        for key, value in current.items()
        if key in ("base_lrs", "_last_lr")
        and isinstance(value, list)
        and isinstance(tree.get(key), list | tuple)
        and len(tree[key]) != len(value)
    ]


def _check_fits(name: str, target: Any, tree: Any) -> None:
    """Raise RestoreMismatchError unless ``tree`` fits the live ``target``; changes nothing.

    Modules: tensor names, shapes, dtypes. Optimizers: group hyper-parameter keys
    (the optimizer type), groups, parameters per group, state shapes and dtypes. Schedulers and GradScaler: their keys. Generators,
    tensors and objects with ``check_state_dict``: see ``stateful.check_state``.
    """
    live = unwrap(target)
    problems: list[str] = []
    if isinstance(live, torch.nn.Module):
        problems = _module_problems(live, tree)
    elif isinstance(live, torch.optim.Optimizer):
        problems = _optimizer_problems(live, tree)
    elif isinstance(live, torch.optim.lr_scheduler.LRScheduler):
        problems = _scheduler_problems(live, tree)
    elif isinstance(live, torch.amp.GradScaler):
        problems = layout_problems(live.state_dict(), tree)
    if problems:
        raise RestoreMismatchError(
            f"component {name!r} does not fit its target: {'; '.join(problems[:8])}"
        )
    check_state(live, tree, name)


def _clone_tree(tree: Any) -> Any:
    """A copy of a state tree owning all its data: tensors cloned to CPU (each tensor
    object once), so a backup of a CUDA model costs host memory, not device memory."""

    def copy_leaf(value: Any) -> Any:
        return value.copy() if isinstance(value, np.ndarray) else copy.deepcopy(value)

    return _map_tree(tree, lambda tensor: tensor.detach().to("cpu", copy=True), copy_leaf)


def _backup(target: Any) -> Any:
    """A copy of a target's current state that owns its data, to roll back a failed restore."""
    return _clone_tree(component_state(target, "backup"))


def _roll_back(targets: Mapping[str, Any], backups: Mapping[str, Any], names: list[str]) -> None:
    """Put every named target back to its backup; raise CheckpointError if any refuses."""
    failures: list[str] = []
    for name in names:
        try:
            load_component(targets[name], backups[name])
        except Exception as exc:
            failures.append(f"{name!r} ({exc})")
    if failures:
        raise CheckpointError(
            f"restore failed and rolling back also failed for {', '.join(failures)}: "
            "those objects may hold a mix of old and restored state"
        )


class RestoreInfo(CheckpointInfo, frozen=True):
    """What ``restore`` returns: the checkpoint's ``CheckpointInfo`` plus what it did.

    ``restored``: components loaded into targets. With ``strict=False``,
    ``skipped_targets`` are targets the checkpoint has no component for (left
    unchanged) and ``skipped_components`` are components no target took.
    """

    restored: tuple[str, ...] = ()
    skipped_targets: tuple[str, ...] = ()
    skipped_components: tuple[str, ...] = ()


def restore(
    root: str,
    targets: Mapping[str, Any],
    step: int | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
    strict: bool = True,
) -> RestoreInfo:
    """Load a checkpoint and ``load_state_dict`` it into the live ``targets``, all or nothing.

    With ``strict`` (the default), every target needs a component and every
    component a target, else RestoreMismatchError names the missing and
    unexpected ones. With ``strict=False`` only the names both sides have are
    restored; the rest is listed in the returned ``RestoreInfo`` and logged as a
    warning on the ``checkpointd`` logger. Either way, every component is read,
    verified and checked against its live target (module tensors, optimizer
    groups and state, generator layouts...) before any target changes; if a
    target still rejects its state, every target is put back as it was and
    RestoreMismatchError is raised. Blocking; call from the training thread.
    """
    store = open_store(str(root), storage_options)
    try:
        found_step, manifest = _resolve_step(store, step)
    finally:
        store.close()
    names = [n for n in targets if n in manifest.components]
    missing = tuple(n for n in targets if n not in manifest.components)
    unexpected = tuple(n for n in manifest.components if n not in targets)
    if strict and (missing or unexpected):
        raise RestoreMismatchError(
            f"step {found_step}: targets without a component: {list(missing) or 'none'}; "
            f"components without a target: {list(unexpected) or 'none'} "
            "(pass strict=False to restore the intersection)"
        )
    for name in names:
        check_restorable(targets[name], name)
    checkpoint = load(root, found_step, components=names, storage_options=storage_options)
    for name in names:
        _check_fits(name, targets[name], checkpoint.state[name])
    backups = {name: _backup(targets[name]) for name in names}
    touched: list[str] = []
    try:
        for name in names:
            # The target is touched before load_state_dict returns: a module copies
            # tensors one by one and may raise half way.
            touched.append(name)
            load_component(targets[name], checkpoint.state[name])
    except Exception as exc:
        _roll_back(targets, backups, touched)
        raise RestoreMismatchError(
            f"component {touched[-1]!r} was rejected by its target ({exc}); nothing was changed"
        ) from exc
    except BaseException:
        _roll_back(targets, backups, touched)
        raise
    if missing or unexpected:
        _log.warning(
            "restore(strict=False) from step %d skipped targets without a component %s and "
            "components without a target %s",
            found_step,
            list(missing),
            list(unexpected),
        )
    info = checkpoint.info
    return RestoreInfo(
        **{f: getattr(info, f) for f in info.__struct_fields__},
        restored=tuple(names),
        skipped_targets=missing,
        skipped_components=unexpected,
    )
