"""Lineage: a restarted job continues its own checkpoints instead of sparing them as another's.

Retention spares another writer instance's fresh checkpoints for a grace
window (maintain/retention.py). A job restarted on its root is a new writer instance,
so without more it would spare its own previous run's checkpoints too and
keep about twice ``keep_last`` for that window. A lineage names a line of
writer instances that continue one another: each manifest records one
(``Manifest.lineage``; an older manifest's lineage is its ``writer``). A
writer starts a lineage of its own, except when this process restored (``load``
or ``restore``, also through the writer) a checkpoint of the same root before the
writer's first commit: then it continues that checkpoint's lineage and prunes the lineage's checkpoints up
to the restored step as its own. Checkpoints after that step, and every
checkpoint of an instance that commits after it (it is still live: two
writers resumed from one checkpoint), stay another writer's. Two writers
that did not resume from one another share nothing and spare each other as
before. Any thread.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from checkpointd import tunables
from checkpointd.format.manifest import Manifest

__all__ = ["Resumed", "WriterIdentity", "lineage_of", "note_resumed", "resumed_from", "root_key"]


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


@dataclass(slots=True)
class WriterIdentity:
    """One writer instance: the random id its manifests carry, and its save interval.

    Used only from the writer's event loop (one save at a time).
    """

    id: str = field(default_factory=lambda: secrets.token_hex(8))
    lineage: str = ""
    """The lineage its manifests record (lineage.py): its own id, or a resumed one's."""
    inherited: int | None = None
    """The step it resumed from: its lineage's checkpoints up to it count as its own."""
    last_commit: float | None = None
    """When this writer last committed (time.monotonic())."""
    interval: float | None = None
    """Seconds between its last two commits."""
    root: str = ""
    """The root it writes ("": none known), whose restores ``follow_resume`` picks up."""

    def __post_init__(self) -> None:
        self.lineage = self.lineage or self.id

    @classmethod
    def for_root(cls, url: str) -> WriterIdentity:
        """A new identity for a writer of root ``url``: continuing the lineage of the
        checkpoint this process restored from it, if any (lineage.py)."""
        identity = cls(root=url)
        identity.follow_resume()
        return identity

    def follow_resume(self) -> None:
        """Before this writer's first commit: continue the lineage of the checkpoint this
        process restored from its root last, also when the restore came after the writer
        was made (``writer.restore``, accelerate's ``load_state(accelerator, writer)``).
        After its first commit the lineage its manifests record stays. Writer's loop."""
        if self.last_commit is not None or not self.root:
            return
        resumed = resumed_from(self.root)
        if resumed is not None:
            self.lineage, self.inherited = resumed.lineage, resumed.step

    def owns(self, step: int, manifest: Manifest, newest: Mapping[str, int]) -> bool:
        """True if checkpoint ``step`` is this writer's to prune without a grace window:
        its own, or its lineage's up to the inherited step from an instance that has
        committed nothing after it (``newest``: each writer id's newest step)."""
        if manifest.writer == self.id:
            return True
        if self.inherited is None or step > self.inherited:
            return False
        if lineage_of(manifest) != self.lineage:
            return False
        return newest.get(manifest.writer, step) <= self.inherited

    def note_commit(self, now: float) -> None:
        """Record a commit at ``now`` (monotonic seconds)."""
        if self.last_commit is not None:
            self.interval = max(0.0, now - self.last_commit)
        self.last_commit = now

    def grace(self) -> float:
        """How long another writer's checkpoint is kept after its commit: tunables.GRACE_SECONDS or
        twice this writer's last save interval, whichever is longer."""
        return max(tunables.GRACE_SECONDS, 2 * (self.interval or 0.0))
