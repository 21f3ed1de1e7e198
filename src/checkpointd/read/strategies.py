"""The four ways restore lands stored bytes in live tensors, and the one choice among them.

A file that restores straight into live tensors (a tensor file, landing.py; a shard file,
boxes.py) is checked, then landed, in one of four ways (the bounced one in two forms,
by whether the file was checked before), chosen once per file by
``choose`` from what the store opened (``Store.open_pinned``) and where the live tensors
are. What each one checks, and when, is what keeps a restore all or nothing
(inplace.py). The memory tier's ``MappedFile`` is told apart here and nowhere else.
No torch; any thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from checkpointd.storage.base import MappedFile, PinnedFile

__all__ = ["BOUNCED", "BOUNCED_MAPPED", "CHECKED_COPY", "REREAD", "WHOLE", "Strategy", "choose"]


@dataclass(frozen=True)
class Strategy:
    """One way to land a file's bytes (the constants below; compare by identity)."""

    name: str
    checked_before: bool
    """The check pass checks the stored bytes against their CRC32C before anything lands."""
    checked_as_landed: bool
    """The landing takes the CRC32C of the bytes as they land and compares it."""
    pinned_unchanged: bool
    """After the landing the pinned file must be unchanged (``PinnedFile.unchanged``)."""


WHOLE = Strategy("whole", checked_before=True, checked_as_landed=False, pinned_unchanged=False)
"""The store cannot pin the file (an object store): the check pass reads it (or the
box's part of a shard) whole into fresh memory, checked, and the landing copies from
that memory. Nothing can fail at landing. Chosen first, whatever the live tensors are."""

BOUNCED = Strategy("bounced", checked_before=True, checked_as_landed=True, pinned_unchanged=False)
"""A live tensor of the file is on a device (``bounce.needs_bounce``): the landing
reads the file's bytes a block at a time into pinned staging, checks each there
(the whole file's CRC32C, or each shard block's) and copies it to the device. A
pinned file is also checked by the check pass; a memory-tier file is not (see
``CHECKED_COPY``: ``checked_before`` is false for it)."""

BOUNCED_MAPPED = Strategy(
    "bounced from memory", checked_before=False, checked_as_landed=True, pinned_unchanged=False
)
"""``BOUNCED`` for a memory-tier file: checked only as it lands (in staging)."""

CHECKED_COPY = Strategy(
    "checked copy", checked_before=False, checked_as_landed=True, pinned_unchanged=False
)
"""The file is the service's memory tier (a ``MappedFile``, in memory already) and the
live tensors are in host memory: the check pass only copies the bytes that do not land
(and the header, which must still lay the file out as planned); the landing copies the
rest straight from the mapping and takes the CRC32C of what landed, in one pass over
memory (``bytecopy.copy_checked``). A mismatch is found only once live tensors hold
bad bytes: it raises CorruptCheckpointError from the landing, and restore reads
storage over them (restore.py). Another process writing into the segment cannot make
unchecked bytes land."""

REREAD = Strategy("reread", checked_before=True, checked_as_landed=False, pinned_unchanged=True)
"""The file is pinned on storage (a POSIX descriptor) and the live tensors are in host
memory: the check pass streams the file through two reused buffers and checks it; the
landing reads the checked bytes again from the same open file straight into the live
tensors, once, and then requires the file unchanged since it was opened (a write into
it raises CorruptCheckpointError)."""


def choose(pinned: PinnedFile | None, on_device: bool) -> Strategy:
    """How a file opened as ``pinned`` (None: the store could not pin it) lands, when
    ``on_device`` says whether any of its live tensors is on a device."""
    if pinned is None:
        return WHOLE
    in_memory = isinstance(pinned, MappedFile)
    if on_device:
        return BOUNCED_MAPPED if in_memory else BOUNCED
    return CHECKED_COPY if in_memory else REREAD
