"""Where a Lightning checkpoint path's checkpointd root is, and which ``last*`` is newest.

Which ``last*.ckpt`` root is the newest: the paths half of
checkpointd.integrations.lightning; imports no Lightning.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from checkpointd.read.catalog import list_checkpoints

__all__ = ["checkpoint_root", "last_checkpoint"]

_LAST = re.compile(r"^last(-v?\d+)?\.ckpt$")  # ModelCheckpoint's last.ckpt, last-v1.ckpt


def checkpoint_root(path: str | os.PathLike[str]) -> str:
    """The checkpointd root a Lightning checkpoint path stands for.

    Args:
        path: A Lightning checkpoint path or URL.

    Returns:
        A URL as is, a local path made absolute with symlinks resolved.
    """
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        return text
    text = text.removeprefix("file://")
    return os.path.realpath(text)


def last_checkpoint(
    dirpath: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
) -> str | None:
    """The ``last*.ckpt`` root under ``dirpath`` committed most recently.

    For S3 and other URLs, where ``ckpt_path="last"`` finds nothing: Lightning lists
    ``dirpath`` with its own filesystem and drops the ``s3://`` of what it finds, then
    looks for those names on the local disk. Called from any thread.

    Args:
        dirpath: ``ModelCheckpoint``'s folder (a local path or URL).
        storage_options: fsspec options for ``dirpath``.

    Returns:
        The root as a path or URL for ``Trainer.fit(ckpt_path=...)``; None if there is none.
    """
    text = os.fspath(dirpath)
    if "://" in text and not text.startswith("file://"):
        import fsspec

        fs, target = fsspec.core.url_to_fs(text, **(storage_options or {}))
        try:
            listed = fs.ls(target, detail=False)
        except FileNotFoundError:
            listed = []
        names = [str(n).rstrip("/").rpartition("/")[2] for n in listed]
        base = text.rstrip("/")
    else:
        base = checkpoint_root(text)
        names = os.listdir(base) if os.path.isdir(base) else []
    newest: tuple[Any, str] | None = None
    for name in names:
        if not _LAST.match(name):
            continue
        url = f"{base}/{name}"
        infos = list_checkpoints(url, storage_options=storage_options)
        if infos and (newest is None or infos[-1].created_at > newest[0]):
            newest = (infos[-1].created_at, url)
    return None if newest is None else newest[1]
