"""Reading checkpoints back: list, load into plain trees, restore into live objects.

Blocking; call from any thread. Loading never runs code (no pickle), never
reads outside the root, and checks each file's size (and, with ``verify``, its
CRC32C) before parsing a byte of it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import torch

from checkpointd import tunables
from checkpointd.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWarning,
    CorruptCheckpointError,
)
from checkpointd.format.manifest import CheckpointInfo, Manifest
from checkpointd.ranks.group import place_in
from checkpointd.read import bounce, catalog, inplace, todevice
from checkpointd.read.apply import Prepared, apply_prepared, prepare
from checkpointd.read.catalog import list_checkpoints
from checkpointd.read.lineage import note_resumed
from checkpointd.read.reader import StepReader
from checkpointd.state.tree import map_tree
from checkpointd.storage import Store, open_store, resolve_root

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
    device = None if map_location is None else bounce.resolved(torch.device(map_location))
    with (
        bounce.Bounce() as staging,  # closed after the pool has joined its threads
        concurrent.futures.ThreadPoolExecutor(tunables.READ_THREADS) as pool,
    ):

        def read(name: str) -> Any:
            part = (templates or {}).get(name)
            if device is None or part or bounce.transfer_for(device) is None:
                return reader.component(name, None, part)
            # Tensor files straight to the device through the bounce buffer (todevice.py).
            on_device = todevice.component_on(reader, name, device, staging)
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
            many-rank job; ``restore(..., service=...)``).
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
    service: str | None = None,
    process_group: Any = None,
) -> RestoreInfo:
    """Load a checkpoint and ``load_state_dict`` it into the live ``targets``, all or nothing.

    With ``strict`` (the default), every target needs a component and every
    component a target. With ``strict=False`` only the names both sides have are
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
    otherwise (no service, not held, a mismatch) from storage. A held copy is checked
    as it lands (one pass over memory): if it turns out damaged, storage is read and
    lands over it, so the targets end as storage's checkpoint; only if storage's copy
    fails its checks too do tensors keep a mix (the error's note says so). A rank of
    a many-rank job reads the files its node's service holds of that step (its share, each listed
    by storage's manifest with the same size and CRC32C) from memory and the others
    from storage: ``info.source`` "memory" if every file came from memory,
    "memory+storage" if some did, else "storage".

    ``process_group`` says which rank's per-rank components (``PerRank``, ``RNGState``)
    this process gets: None the default group's (this process alone without
    torch.distributed), a sub-group its rank there (the group a writer saved with),
    ``checkpointd.LOCAL`` those of rank 0 of 1. DTensors reshard by their own meshes;
    restore itself makes no collective call.

    Args:
        root: A local path or fsspec URL.
        targets: Component name -> the live object to restore into (a module, an
            optimizer, a Stateful, a dict of tensors...).
        step: The step to restore; None: the newest committed one that reads and verifies.
        storage_options: fsspec options for ``root`` (credentials, endpoint...).
        strict: Require a component for every target and a target for every component.
        service: "auto" or a checkpoint service's socket path, to read a held copy
            from memory; None: storage only.
        process_group: Whose per-rank components this process gets (see above).

    Returns:
        The restored checkpoint's CheckpointInfo, with what was restored and skipped
        and where the bytes came from (``source``).

    Raises:
        RestoreMismatchError: A target and the checkpoint do not match (names with
            ``strict``, or a target rejects its state); every target is as it was.
        CheckpointNotFoundError: Nothing (or not that step) is committed.
        CorruptCheckpointError: A file of the step fails its checks; with
            ``step=None``, when no committed checkpoint reads and verifies.
    """
    place = place_in(process_group)
    root = resolve_root(str(root))  # the service's working folder is not this process's
    from_memory: CheckpointError | None = None
    if service is not None:
        from checkpointd.daemon.recall import held_copy

        with held_copy(
            root, step, storage_options=storage_options, service=service, rank=place[0]
        ) as held:
            if held is not None:
                try:
                    info = restore_from(held.store, targets, held.step, strict, place=place)
                    return msgspec.structs.replace(info, source=held.source())
                except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
                    from_memory = exc  # a damaged or partial copy: storage decides
    try:
        return restore_from(open_store(root, storage_options), targets, step, strict, place=place)
    except CheckpointError as exc:
        if from_memory is not None:  # it may have landed some bytes before it failed
            exc.add_note(
                f"before storage was read, the service's memory copy failed: {from_memory}"
            )
        raise


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
