"""What a writer opens from its options, in order: the store of its root, the group of
ranks it saves with, and its write service (in this process, or the checkpoint
service's stand-in). Each step closes what it opened if a later part of it fails; the
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
from checkpointd.write.loop import WriteService
from checkpointd.write.options import WriterOptions

if TYPE_CHECKING:
    from checkpointd.daemon.remote import RemoteService

__all__ = ["open_group", "open_root", "open_service"]


def open_root(root: str, options: WriterOptions) -> Store:
    """The store of a writer's root; StorageError if a local root is a file."""
    store = open_store(root, options.storage_options)
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


def open_service(
    root: str,
    store: Store,
    options: WriterOptions,
    ranks: Group | None,
) -> WriteService | RemoteService:
    """The write service: in this process, or the checkpoint service's stand-in.
    Closes ``ranks`` if it cannot be made."""
    try:
        if options.service is None:
            return WriteService(
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
        from checkpointd.daemon.remote import open_remote

        return open_remote(root, options, ranks)
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise
