"""What a writer opens from its target and options, in order: the store of its root, the
group of ranks it saves with, and its backend (backend.py: in this process, or through
the checkpoint service), chosen here once. Each step closes what it opened if a later part of it fails; the
writer closes the earlier ones. Caller's thread, blocking (the group waits for its
ranks)."""

from __future__ import annotations

import errno
import os
import sys
from typing import TYPE_CHECKING

from checkpointd.errors import StorageError
from checkpointd.ranks.group import LOCAL, Group, resolve_group
from checkpointd.storage import LocalStore, Store, open_store
from checkpointd.write.loop import InProcessBackend
from checkpointd.write.options import SaveTarget, WriterOptions

if TYPE_CHECKING:
    from checkpointd.write.backend import WriteBackend

__all__ = ["open_backend", "open_group", "open_root"]


def open_root(target: SaveTarget) -> Store:
    """The store of a writer's root; StorageError if a local root is a file."""
    root = target.root
    store = open_store(root, target.storage_options)
    local = store.root if isinstance(store, LocalStore) else None
    if local is not None and os.path.exists(local) and not os.path.isdir(local):
        store.close()
        raise StorageError(errno.ENOTDIR, f"checkpoint root {root} is a file, not a folder")
    return store


def open_group(store: Store, options: WriterOptions) -> Group | None:
    """The group a writer of ``store``'s root saves with: none (alone) unless
    torch.distributed is initialized with more than one rank in ``process_group`` and
    it is not LOCAL; re-keyed for the checkpoint service when the writer uses one
    (ranks/hosted.py). Imports torch.distributed only when it is in use."""
    process_group = options.process_group
    if process_group is LOCAL or (process_group is None and "torch.distributed" not in sys.modules):
        return None
    local = store.root if isinstance(store, LocalStore) else None
    group = resolve_group(
        process_group, local or store.url.rstrip("/"), join_seconds=options.join_seconds
    )
    if group is None or options.service is None:
        return group
    from checkpointd.ranks.hosted import for_service

    return for_service(group)


def open_backend(
    target: SaveTarget,
    store: Store,
    options: WriterOptions,
    ranks: Group | None,
) -> WriteBackend:
    """The writer's backend: ``InProcessBackend`` without ``service=``, else
    ``ServiceBackend`` (the service opens its own store from ``target``; ``store`` stays
    the writer's, for reads). Closes ``ranks`` if it cannot be made."""
    try:
        if options.service is None:
            return InProcessBackend(
                store,
                options.policy,
                options.max_pending,
                options.max_concurrency,
                options.newer_steps,
                group=ranks,
                incremental=options.incremental,
                chunk_bytes=options.chunk_bytes,
                pool=options.buffer_pool,
            )
        from checkpointd.daemon.client.remote import open_remote

        return open_remote(target, options, ranks)
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise
