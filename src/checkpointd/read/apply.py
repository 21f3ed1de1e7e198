"""Restoring one committed step into live targets, all or nothing: match components to
targets, read and check everything (``prepare``, no target touched), then load every
target and land the bytes read straight into their tensors (``apply_prepared``), rolling
back if anything refuses. Training thread; see inplace.py for why the order is safe."""

from __future__ import annotations

import concurrent.futures
import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from checkpointd import tunables
from checkpointd.errors import (
    CheckpointError,
    CorruptCheckpointError,
    RestoreMismatchError,
)
from checkpointd.format.manifest import CheckpointInfo, Manifest
from checkpointd.ranks.group import per_rank_targets
from checkpointd.read import catalog, inplace
from checkpointd.read.bounce import Bounce
from checkpointd.read.reader import StepReader
from checkpointd.state.fit import check_fits, check_restorable
from checkpointd.state.loading import dtensor_templates, load_component
from checkpointd.state.stateful import component_state
from checkpointd.state.tree import map_tree
from checkpointd.storage import Store

__all__ = ["Prepared", "apply_prepared", "prepare"]


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
            load_component(name, targets[name], backups[name])
        except Exception as exc:
            failures.append(f"{name!r} ({exc})")
    if failures:
        raise CheckpointError(
            f"restore failed and rolling back also failed for {', '.join(failures)}: "
            "those objects may hold a mix of old and restored state"
        )


@dataclass(slots=True)
class Prepared:
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
    world: int = 1
    """The world size of the group that restores (this job's, or a sub-group's)."""

    def skipped_message(self) -> str:
        """What ``strict=False`` left out, in words ("" if nothing)."""
        parts = []
        if self.missing:
            parts.append(f"targets without a component {list(self.missing)}")
        if self.other_world:
            parts.append(
                f"per-rank targets {list(self.other_world)} (their components were saved by "
                f"{self.saved_world} ranks, this job has {self.world})"
            )
        if self.unexpected:
            parts.append(f"components without a target {list(self.unexpected)}")
        return "; ".join(parts)


def prepare(
    store: Store,
    found_step: int,
    manifest: Manifest,
    targets: Mapping[str, Any],
    strict: bool,
    *,
    place: tuple[int, int] = (0, 1),
) -> Prepared:
    """Match one step's components to the targets and read them; touches no target.
    ``place``: this process's (rank, world size) in the group that restores."""
    targets, others, skipped = per_rank_targets(manifest, targets, strict, place)
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
    return Prepared(
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
        place[1],
    )


def apply_prepared(prepared: Prepared) -> None:
    """Fit checks, then load every target (rolled back if one refuses), then land the
    direct tensors' bytes (inplace.py explains why this order is all or nothing)."""
    targets, names, planned = prepared.targets, prepared.names, prepared.planned
    for name in names:
        check_fits(name, targets[name], planned[name].tree, targets)
    backups = {
        name: inplace.backup(targets[name], planned[name])
        if planned[name].lands()
        else _backup(targets[name])
        for name in names
    }
    touched: list[str] = []
    try:
        for name in names:
            # The target is touched before load_state_dict returns: a module copies
            # tensors one by one and may raise half way.
            touched.append(name)
            load_component(name, targets[name], planned[name].tree, targets)
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
        with Bounce() as staging:  # one bounce buffer for every device tensor landed
            for name in names:
                if planned[name].lands():
                    landed.append(name)
                    inplace.land(prepared.where, planned[name], staging)
    except BaseException as exc:
        _roll_back(targets, backups, touched)
        if not isinstance(exc, Exception):
            raise  # KeyboardInterrupt and the like keep their type
        raise CorruptCheckpointError(
            f"restore failed while reading tensors into their targets ({exc}); the other "
            f"state was rolled back, but tensors of {landed} may hold a mix of old and "
            "restored values"
        ) from exc
