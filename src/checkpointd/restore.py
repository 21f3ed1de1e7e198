"""Reading checkpoints back: list, load into plain trees, restore into live objects.

Blocking; call from any thread. Loading never runs code (no pickle), never
reads outside the root, and checks each file's size (and, with ``verify``, its
CRC32C) before parsing a byte of it.
"""

from __future__ import annotations

import concurrent.futures
import copy
import logging
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from checkpointd import catalog, inplace, tunables
from checkpointd.catalog import list_checkpoints
from checkpointd.distributed import per_rank_targets
from checkpointd.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWarning,
    CorruptCheckpointError,
    RestoreMismatchError,
)
from checkpointd.fit import check_fits, check_restorable
from checkpointd.lineage import note_resumed
from checkpointd.manifest import CheckpointInfo, Manifest
from checkpointd.reader import StepReader
from checkpointd.stateful import component_state, dtensor_templates, load_component
from checkpointd.storage import Store, open_store
from checkpointd.tree import map_tree

__all__ = [
    "Checkpoint",
    "RestoreInfo",
    "SkippedStep",
    "list_checkpoints",
    "load",
    "restore",
    "restore_from",
]

_log = logging.getLogger("checkpointd")
_warned: set[str] = set()
_warned_lock = threading.Lock()
_MAX_WARNED = 1024


def _warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time only (``build`` restores with
    ``strict=False`` on every call); at most ``_MAX_WARNED`` distinct ones are remembered."""
    with _warned_lock:
        if message in _warned:
            return
        if len(_warned) < _MAX_WARNED:
            _warned.add(message)
    _log.warning("%s", message)


_T = TypeVar("_T")

SkippedStep = tuple[int, str]
"""(step, why) of a damaged checkpoint that ``load``/``restore`` with ``step=None`` passed over."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A loaded checkpoint: ``info`` and ``state[component]`` (its state tree).

    ``skipped_steps``: newer checkpoints that were damaged and passed over (only
    with ``step=None``), newest first, each as (step, why).
    """

    info: CheckpointInfo
    state: dict[str, Any]
    skipped_steps: tuple[SkippedStep, ...] = ()


def _newest_good(
    store: Store, step: int | None, attempt: Callable[[int, Manifest], _T]
) -> tuple[_T, tuple[SkippedStep, ...]]:
    """``attempt(step, manifest)`` on ``step``, or with ``step=None`` on the newest
    committed step it succeeds on, newest first.

    With ``step=None`` a step whose manifest cannot be read or whose ``attempt``
    raises CorruptCheckpointError (a missing file, a size, CRC32C, header or tree
    check) is skipped with a CheckpointWarning naming it and why; other errors
    (a missing component, a mismatch) propagate. Returns (result, skipped steps);
    CorruptCheckpointError if every committed step was damaged.
    """
    if step is not None:
        manifest = catalog.read_manifest(store, step)
        result = attempt(step, manifest)
        note_resumed(store.url, step, manifest)
        return result, ()
    skipped: list[SkippedStep] = []

    def skip(found: int, exc: CheckpointError) -> None:
        skipped.append((found, str(exc)))

    for found, manifest in catalog.scan(store, on_damaged=skip):
        try:
            result = attempt(found, manifest)
        except CorruptCheckpointError as exc:
            skip(found, exc)
            continue
        note_resumed(store.url, found, manifest)
        for bad, why in skipped:
            warnings.warn(
                f"skipping step {bad} (damaged; fell back to step {found}): {why}",
                CheckpointWarning,
                stacklevel=3,
            )
        return result, tuple(skipped)
    if skipped:
        # No warnings here: the error lists every damaged step.
        listed = "; ".join(f"step {s}: {why}" for s, why in skipped)
        raise CorruptCheckpointError(
            f"no checkpoint under {store.url} verifies ({len(skipped)} damaged: {listed})"
        )
    raise CheckpointNotFoundError(
        f"no committed checkpoint under {store.url}; save one first or check the path"
    )


def _move(tree: Any, device: torch.device) -> Any:
    """Move every tensor of a tree to ``device``, keeping aliased tensors aliased."""
    return map_tree(tree, lambda tensor: tensor.to(device))


def _load_from(
    store: Store,
    step: int,
    manifest: Manifest,
    *,
    components: Iterable[str] | None,
    map_location: str | torch.device | None,
    verify: bool,
    templates: Mapping[str, Mapping[str, Any]] | None = None,
) -> Checkpoint:
    """Read the named components of a committed step whose manifest is already read;
    ``templates[component]`` names the live DTensors to read only this rank's part of."""
    wanted = list(manifest.components) if components is None else list(components)
    missing = [name for name in wanted if name not in manifest.components]
    if missing:
        raise CheckpointNotFoundError(
            f"step {step} has no component {', '.join(map(repr, missing))} "
            f"(it has: {', '.join(manifest.components)})"
        )
    reader = StepReader(store, step, manifest, verify=verify)
    with concurrent.futures.ThreadPoolExecutor(tunables.READ_THREADS) as pool:
        futures = {
            name: pool.submit(reader.component, name, None, (templates or {}).get(name))
            for name in wanted
        }
        state = {name: future.result() for name, future in futures.items()}
    if map_location is not None:
        device = torch.device(map_location)
        state = {name: _move(tree, device) for name, tree in state.items()}
    info = CheckpointInfo.from_manifest(manifest, catalog.step_path(store, step))
    return Checkpoint(info, state)


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
    CorruptCheckpointError if a size, digest or header check of ``step`` fails.
    With ``step=None``, damaged checkpoints are skipped (a CheckpointWarning for
    each, listed in ``skipped_steps``) and the newest one that reads and verifies
    is returned; CorruptCheckpointError if none does.
    """
    store = open_store(str(root), storage_options)
    try:

        def attempt(found: int, manifest: Manifest) -> Checkpoint:
            return _load_from(
                store,
                found,
                manifest,
                components=components,
                map_location=map_location,
                verify=verify,
            )

        checkpoint, skipped = _newest_good(store, step, attempt)
    finally:
        store.close()
    if skipped:
        return Checkpoint(checkpoint.info, checkpoint.state, skipped)
    return checkpoint


def _clone_tree(tree: Any) -> Any:
    """A copy of a state tree owning all its data: tensors cloned to CPU (each tensor
    object once), so a backup of a CUDA model costs host memory, not device memory."""

    def copy_leaf(value: Any) -> Any:
        return value.copy() if isinstance(value, np.ndarray) else copy.deepcopy(value)

    return map_tree(tree, lambda tensor: tensor.detach().to("cpu", copy=True), copy_leaf)


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
    ``skipped_targets`` are targets the checkpoint has no component for, or whose
    per-rank components another world size saved (left unchanged), and
    ``skipped_components`` are components no target took.
    ``skipped_steps``: with ``step=None``, newer damaged checkpoints passed over,
    newest first, each as (step, why). ``source``: "storage", or "memory" where the
    checkpoint service's memory tier served the bytes (``restore(..., service=...)``).
    """

    source: str = "storage"
    restored: tuple[str, ...] = ()
    skipped_targets: tuple[str, ...] = ()
    skipped_components: tuple[str, ...] = ()
    skipped_steps: tuple[SkippedStep, ...] = ()


@dataclass(slots=True)
class _Prepared:
    """One step read and checked for restore, no target touched yet."""

    step: int
    info: CheckpointInfo
    planned: dict[str, inplace.Planned]
    targets: Mapping[str, Any]
    names: list[str]
    missing: tuple[str, ...]
    """Targets the checkpoint has no component for."""
    other_world: tuple[str, ...]
    """Per-rank targets whose components another world size saved (``strict=False``)."""
    unexpected: tuple[str, ...]
    saved_world: int
    where: str

    def skipped_message(self) -> str:
        """What ``strict=False`` left out, in words ("" if nothing)."""
        parts = []
        if self.missing:
            parts.append(f"targets without a component {list(self.missing)}")
        if self.other_world:
            parts.append(
                f"per-rank targets {list(self.other_world)} (their components were saved by "
                f"{self.saved_world} ranks, this job has {_world_size()})"
            )
        if self.unexpected:
            parts.append(f"components without a target {list(self.unexpected)}")
        return "; ".join(parts)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _prepare(
    store: Store, found_step: int, manifest: Manifest, targets: Mapping[str, Any], strict: bool
) -> _Prepared:
    """Match one step's components to the targets and read them; touches no target."""
    targets, others, skipped = per_rank_targets(manifest, targets, strict)
    names = [n for n in targets if n in manifest.components]
    missing = tuple(n for n in targets if n not in manifest.components)
    unexpected = tuple(n for n in manifest.components if n not in targets and n not in others)
    if strict and (missing or unexpected):
        raise RestoreMismatchError(
            f"step {found_step}: targets without a component: {list(missing) or 'none'}; "
            f"components without a target: {list(unexpected) or 'none'} "
            "(pass strict=False to restore the intersection)"
        )
    for name in names:
        check_restorable(targets[name], name)
    templates = {name: dtensor_templates(name, targets[name], targets) for name in names}
    # The manifest read above is the one the files are checked against: read once.
    reader = StepReader(store, found_step, manifest, verify=True)
    planned: dict[str, inplace.Planned] = {}
    with concurrent.futures.ThreadPoolExecutor(tunables.READ_THREADS) as pool:
        futures = {
            name: pool.submit(
                inplace.read_for_restore, reader, name, targets[name], templates[name]
            )
            for name in names
        }
        try:
            for name, future in futures.items():
                planned[name] = future.result()
        except BaseException:
            concurrent.futures.wait(futures.values())
            inplace.release(
                [f.result() for f in futures.values() if not f.cancelled() and not f.exception()]
            )
            raise
    info = CheckpointInfo.from_manifest(manifest, catalog.step_path(store, found_step))
    saved_world = max((len(keys) for keys in manifest.per_rank.values()), default=1)
    return _Prepared(
        found_step,
        info,
        planned,
        targets,
        names,
        missing,
        skipped,
        unexpected,
        saved_world,
        reader.where,
    )


def _apply(prepared: _Prepared) -> None:
    """Fit checks, then load every target (rolled back if one refuses), then land the
    direct tensors' bytes (inplace.py explains why this order is all or nothing)."""
    targets, names, planned = prepared.targets, prepared.names, prepared.planned
    for name in names:
        check_fits(name, targets[name], planned[name].tree, targets)
    backups = {
        name: inplace.backup(targets[name], planned[name])
        if planned[name].landings
        else _backup(targets[name])
        for name in names
    }
    touched: list[str] = []
    try:
        for name in names:
            # The target is touched before load_state_dict returns: a module copies
            # tensors one by one and may raise half way.
            touched.append(name)
            load_component(targets[name], planned[name].tree, targets)
    except Exception as exc:
        _roll_back(targets, backups, touched)
        raise RestoreMismatchError(
            f"component {touched[-1]!r} was rejected by its target ({exc}); nothing was changed"
        ) from exc
    except BaseException:
        _roll_back(targets, backups, touched)
        raise
    if lost := [n for n in names if not inplace.still_held(targets[n], planned[n])]:
        _roll_back(targets, backups, touched)
        raise CheckpointError(
            f"target(s) {lost} did not keep their own tensors when loading; nothing was "
            "changed (please report this as a checkpointd bug)"
        )
    landed: list[str] = []
    try:
        for name in names:
            if planned[name].landings:
                landed.append(name)
                inplace.land(prepared.where, planned[name])
    except BaseException as exc:
        _roll_back(targets, backups, touched)
        if not isinstance(exc, Exception):
            raise  # KeyboardInterrupt and the like keep their type
        raise CorruptCheckpointError(
            f"restore failed while reading tensors into their targets ({exc}); the other "
            f"state was rolled back, but tensors of {landed} may hold a mix of old and "
            "restored values"
        ) from exc


def restore(
    root: str,
    targets: Mapping[str, Any],
    step: int | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
    strict: bool = True,
    service: str | None = None,
) -> RestoreInfo:
    """Load a checkpoint and ``load_state_dict`` it into the live ``targets``, all or nothing.

    With ``strict`` (the default), every target needs a component and every
    component a target, else RestoreMismatchError names the missing and
    unexpected ones. With ``strict=False`` only the names both sides have are
    restored; the rest is listed in the returned ``RestoreInfo`` and logged as a
    warning on the ``checkpointd`` logger (once per distinct message). Either
    way, every component is read, verified and checked against its live target
    (module tensors, optimizer groups and state, generator layouts...) before
    any target changes; if a target still rejects its state, every target is
    put back as it was and RestoreMismatchError is raised. With ``step=None``, damaged checkpoints are
    skipped as in ``load`` (before any target changes; ``skipped_steps``).
    Blocking; call from the training thread.

    ``service`` ("auto" or a socket path; None: storage only): if the checkpoint
    service holds the step to restore (the newest committed one on storage, or
    ``step``) in memory, committed with the very manifest storage has, it is read
    from there, with every check made on storage (``info.source == "memory"``);
    otherwise (no service, not held, a mismatch) from storage.
    """
    if service is not None:
        from checkpointd.daemon.recall import restore_held

        held = restore_held(
            str(root),
            targets,
            step,
            storage_options=storage_options,
            strict=strict,
            service=service,
        )
        if held is not None:
            return held
    return restore_from(open_store(str(root), storage_options), targets, step, strict)


def restore_from(
    store: Store,
    targets: Mapping[str, Any],
    step: int | None,
    strict: bool,
    *,
    source: str = "storage",
) -> RestoreInfo:
    """``restore`` from an open ``store`` (closed here); ``source`` goes in the info."""
    try:

        def attempt(found: int, manifest: Manifest) -> _Prepared:
            return _prepare(store, found, manifest, targets, strict)

        prepared, skipped_steps = _newest_good(store, step, attempt)
    finally:
        store.close()
    try:
        _apply(prepared)
    finally:
        inplace.release(list(prepared.planned.values()))
    names = prepared.names
    if skipped := prepared.skipped_message():
        _warn_once(
            f"restore(strict=False) from step {prepared.step} of {store.url} skipped {skipped}"
        )
    info = prepared.info
    return RestoreInfo(
        **{f: getattr(info, f) for f in info.__struct_fields__},
        restored=tuple(names),
        skipped_targets=(*prepared.missing, *prepared.other_world),
        skipped_components=prepared.unexpected,
        skipped_steps=skipped_steps,
        source=source,
    )
