"""Reading checkpoints back from storage: list, load into plain trees, restore into live objects.

``api/restore.py`` is the public restore: this one, or first the service's memory tier.

Blocking; call from any thread. Loading never runs code (no pickle), never
reads outside the root, and checks each file's size (and, with ``verify``, its
CRC32C) before parsing a byte of it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from checkpointd import tunables
from checkpointd.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWarning,
    CorruptCheckpointError,
)
from checkpointd.format.manifest import CheckpointInfo, Manifest
from checkpointd.read import catalog
from checkpointd.read.catalog import list_checkpoints
from checkpointd.read.lineage import note_resumed
from checkpointd.read.reader import StepReader
from checkpointd.state.tree import map_tree
from checkpointd.storage import Store, open_store, resolve_root

if TYPE_CHECKING:
    from checkpointd.read.apply import Prepared

# What only a restore (read/apply.py, inplace.py and what they import: ranks, boxes,
# landing, state/fit...) or a load onto a device (bounce.py, todevice.py) needs is
# imported where it is used: a fresh process's first ``load`` pays for importing the
# modules it runs, not ~30 ms of the restore path's.

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


def _warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time only.

    ``build`` restores with ``strict=False`` on every call; at most ``tunables.RESTORE_WARNINGS_KEPT`` distinct
    ones are remembered.
    """
    with _warned_lock:
        if message in _warned:
            return
        if len(_warned) < tunables.RESTORE_WARNINGS_KEPT:
            _warned.add(message)
    _log.warning("%s", message)


_T = TypeVar("_T")

SkippedStep = tuple[int, str]
"""(step, why) of a damaged checkpoint that ``load``/``restore`` with ``step=None`` passed over."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A loaded checkpoint: ``info`` and ``state[component]`` (its state tree).

    Attributes:
        info: What the checkpoint is (step, path, metrics...).
        state: Component name -> its state tree (tensors, JSON values).
        skipped_steps: Newer checkpoints that were damaged and passed over (only with
            ``step=None``), newest first, each as (step, why).
    """

    info: CheckpointInfo
    state: dict[str, Any]
    skipped_steps: tuple[SkippedStep, ...] = ()


def _newest_good(
    store: Store, step: int | None, attempt: Callable[[int, Manifest], _T]
) -> tuple[_T, tuple[SkippedStep, ...]]:
    """``attempt(step, manifest)`` on ``step``, or on the newest step it succeeds on.

    With ``step=None``: committed steps are tried newest first.

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
    """Read the named components of a committed step whose manifest is already read.

    ``templates[component]`` names the live DTensors to read only this rank's part of.
    """
    wanted = list(manifest.components) if components is None else list(components)
    missing = [name for name in wanted if name not in manifest.components]
    if missing:
        raise CheckpointNotFoundError(
            f"step {step} has no component {', '.join(map(repr, missing))} "
            f"(it has: {', '.join(manifest.components)})"
        )
    reader = StepReader(store, step, manifest, verify=verify)
    device: torch.device | None = None
    staging: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if map_location is not None:
        from checkpointd.read import bounce

        device = bounce.resolved(torch.device(map_location))
        staging = bounce.Bounce()
    with (
        staging as held,  # closed after the pool has joined its threads
        concurrent.futures.ThreadPoolExecutor(tunables.READ_THREADS) as pool,
    ):

        def read(name: str) -> Any:
            part = (templates or {}).get(name)
            if device is None or part:
                return reader.component(name, None, part)
            from checkpointd.read import bounce, todevice

            if bounce.transfer_for(device) is None:
                return reader.component(name, None, part)
            # Tensor files straight to the device through the bounce buffer (todevice.py).
            on_device = todevice.component_on(reader, name, device, held)
            return reader.component(name, None, part, preloaded=on_device)

        futures = {name: pool.submit(read, name) for name in wanted}
        state = {name: future.result() for name, future in futures.items()}
    if device is not None:
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
    ``map_location``. With ``step=None``, damaged checkpoints are skipped (a
    CheckpointWarning for each, listed in ``skipped_steps``) and the newest one that
    reads and verifies is returned. Blocking.

    Args:
        root: A local path or fsspec URL.
        step: The step to load; None: the newest committed one that reads and verifies.
        components: The names of the components to load; None: all of them.
        storage_options: fsspec options for ``root`` (credentials, endpoint...).
        map_location: A device (or its name) for the tensors; None: CPU.
        verify: Check the bytes read against the manifest's CRC32Cs.

    Returns:
        The checkpoint: its ``info`` and ``state`` (component name -> state tree).

    Raises:
        CheckpointNotFoundError: Nothing (or not that step, or not that component) is
            committed.
        CorruptCheckpointError: A size, digest or header check of ``step`` fails; with
            ``step=None``, when no committed checkpoint reads and verifies.
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


class RestoreInfo(CheckpointInfo, frozen=True):
    """What ``restore`` returns: the checkpoint's ``CheckpointInfo`` plus what it did.

    Attributes:
        source: "storage", "memory" where the checkpoint service's memory tier served
            every file read, or "memory+storage" where it served some (a rank of a
            many-rank job; ``restore(..., service=...)``); "peer" where the copy was
            another node's, fetched by this node's service; several joined by "+" in
            the order memory, peer, storage ("memory+peer", "peer+storage"...).
        restored: Components loaded into targets.
        skipped_targets: With ``strict=False``, targets the checkpoint has no component
            for, or whose per-rank components another world size saved (left unchanged).
        skipped_components: With ``strict=False``, components no target took.
        skipped_steps: With ``step=None``, newer damaged checkpoints passed over, newest
            first, each as (step, why).
    """

    source: str = "storage"
    restored: tuple[str, ...] = ()
    skipped_targets: tuple[str, ...] = ()
    skipped_components: tuple[str, ...] = ()
    skipped_steps: tuple[SkippedStep, ...] = ()


def restore(
    root: str,
    targets: Mapping[str, Any],
    step: int | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
    strict: bool = True,
    process_group: Any = None,
) -> RestoreInfo:
    """``checkpointd.restore`` from storage alone: ``load_state_dict`` into ``targets``.

    All or nothing, as ``process_group``'s rank; ``api/restore.py`` adds the service's
    memory tier and documents the contract.
    """
    from checkpointd.ranks.group import place_in

    place = place_in(process_group)
    root = resolve_root(str(root))
    return restore_from(open_store(root, storage_options), targets, step, strict, place=place)


def restore_from(
    store: Store,
    targets: Mapping[str, Any],
    step: int | None,
    strict: bool,
    *,
    place: tuple[int, int] = (0, 1),
) -> RestoreInfo:
    """``restore`` from an open ``store``, which is closed here.

    The info's ``source`` is "storage"; ``place`` is this process's (rank, world size) in
    the group that restores.
    """
    from checkpointd.read import inplace
    from checkpointd.read.apply import apply_prepared, prepare

    try:

        def attempt(found: int, manifest: Manifest) -> Prepared:
            return prepare(store, found, manifest, targets, strict, place=place)

        prepared, skipped_steps = _newest_good(store, step, attempt)
    finally:
        store.close()
    try:
        apply_prepared(prepared)
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
        source="storage",
    )
