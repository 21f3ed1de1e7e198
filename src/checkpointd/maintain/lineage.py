"""Lineage: a restarted job continues its own checkpoints instead of sparing them as another's.

Retention spares another writer instance's fresh checkpoints for a grace
window (retention.py). A job restarted on its root is a new writer instance,
so without more it would spare its own previous run's checkpoints too and
keep about twice ``keep_last`` for that window. A lineage names a line of
writer instances that continue one another: each manifest records one
(``Manifest.lineage``; an older manifest's lineage is its ``writer``). A
writer starts a lineage of its own, except when this process restored (``load``
or ``restore``) a checkpoint of the same root before the writer opened: then
it continues that checkpoint's lineage and prunes the lineage's checkpoints up
to the restored step as its own. Checkpoints after that step, and every
checkpoint of an instance that commits after it (it is still live: two
writers resumed from one checkpoint), stay another writer's. Two writers
that did not resume from one another share nothing and spare each other as
before. Any thread.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from checkpointd.format.manifest import Manifest

__all__ = ["Resumed", "lineage_of", "note_resumed", "resumed_from", "root_key"]


@dataclass(frozen=True, slots=True)
class Resumed:
    """The checkpoint a process restored from a root: its step and lineage."""

    step: int
    lineage: str


_lock = threading.Lock()
_resumed: dict[str, Resumed] = {}


def root_key(url: str) -> str:
    """One spelling per root: a local path absolute with symlinks resolved, a URL as is."""
    if "://" in url and not url.startswith("file://"):
        return url.rstrip("/")
    return os.path.realpath(url.removeprefix("file://"))


def lineage_of(manifest: Manifest) -> str:
    """The lineage ``manifest`` belongs to ("" if unknown)."""
    return manifest.lineage or manifest.writer


def note_resumed(url: str, step: int, manifest: Manifest) -> None:
    """Record that this process restored ``step`` of root ``url`` (restore.py)."""
    lineage = lineage_of(manifest)
    if lineage:
        with _lock:
            _resumed[root_key(url)] = Resumed(step, lineage)


def resumed_from(url: str) -> Resumed | None:
    """The checkpoint of root ``url`` this process restored last, if any."""
    with _lock:
        return _resumed.get(root_key(url))
