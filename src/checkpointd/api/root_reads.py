"""A writer's reads of its own root: list, load and restore, with its storage options.

Both front ends inherit ``RootReads``; their public ``list_checkpoints``, ``load`` and
``restore`` call these on the caller's thread (CheckpointWriter) or a worker thread
(AsyncCheckpointWriter). They see committed checkpoints only, never pending saves, and
a many-rank writer restores with its own process group.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from checkpointd.api.restore import restore
from checkpointd.format.manifest import CheckpointInfo
from checkpointd.read.restore import Checkpoint, RestoreInfo, list_checkpoints, load
from checkpointd.write.options import WriterOptions

__all__ = ["RootReads"]


class RootReads:
    """What a writer reads back from ``root``, as ``options`` say (set by the writer)."""

    root: str
    options: WriterOptions

    def _storage_options(self) -> dict[str, Any] | None:
        given = self.options.storage_options
        return None if given is None else dict(given)

    def _list(self) -> list[CheckpointInfo]:
        return list_checkpoints(self.root, storage_options=self._storage_options())

    def _load(
        self,
        step: int | None,
        components: Iterable[str] | None,
        map_location: str | torch.device | None,
        verify: bool,
    ) -> Checkpoint:
        return load(
            self.root,
            step,
            components=components,
            storage_options=self._storage_options(),
            map_location=map_location,
            verify=verify,
        )

    def _restore(self, targets: Mapping[str, Any], step: int | None, strict: bool) -> RestoreInfo:
        return restore(
            self.root,
            targets,
            step,
            storage_options=self._storage_options(),
            strict=strict,
            process_group=self.options.process_group,
        )
