"""``checkpointd.restore``: from storage, or first from the service's memory tier.

Storage is ``read/restore.py``; with ``service=``, a held copy is read through
``daemon/client/recall.py`` first. This module sits above ``read/`` and ``daemon/`` because
it joins them: the reader never imports the service. Blocking; call from the training
thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from checkpointd.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from checkpointd.ranks.group import place_in
from checkpointd.read.restore import RestoreInfo, restore_from
from checkpointd.storage import open_store, resolve_root

__all__ = ["restore"]


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
    by storage's manifest with the same size and CRC32C) from memory; another saved
    rank's files (resharding) from that rank's share, in its node's memory or a peer's
    (docs/peers.md); the rest from storage: ``info.source`` "memory" if every file
    came from memory, "memory+storage" if some did, else "storage" ("peer" for a copy
    another node's service held; several joined by "+": "memory+peer+storage").

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
        from checkpointd.daemon.client.peering import join_restore
        from checkpointd.daemon.client.recall import held_copy

        join_restore(service, root, storage_options, process_group)  # many ranks: collective

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
