"""The Lightning job of lightning_job.py, stopped at a chosen point of a root's removal so
that a test can SIGKILL it there: ``python -m tests.support.lightning_kill_job MODE
SIGNAL DIRPATH --kwargs JSON``.

MODE ``unlink``: the thread deleting a top-k root stops right after a file of one of its
step folders is unlinked while that folder's manifest still exists (a torn checkpoint),
or else after the second file of the third step folder it deletes. MODE ``delete``: the
deletion thread stops as it starts deleting the first removed root (a deferred removal
Lightning asked for). Either way it writes SIGNAL (JSON: the folder or root, and whether
a checkpoint was torn) and waits forever.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

from tests.support import lightning_job

_lock = threading.Lock()
_folders: dict[str, int] = {}  # step folder -> files unlinked from it


def _stop(signal_path: str, **what: Any) -> None:
    with open(signal_path + ".tmp", "w") as f:
        json.dump(what, f)
    os.rename(signal_path + ".tmp", signal_path)
    threading.Event().wait()  # until the test kills the process


def _watch_unlinks(signal_path: str) -> None:
    real = os.unlink

    def unlink(path: Any, *args: Any, dir_fd: int | None = None, **kwargs: Any) -> None:
        real(path, *args, dir_fd=dir_fd, **kwargs)
        if not threading.current_thread().name.startswith("checkpointd-lightning"):
            return  # not the plugin's deletion thread (a writer's own temp files...)
        full = os.fsdecode(path)
        if dir_fd is not None:
            full = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), full)
        folder, name = os.path.split(full)
        root = os.path.dirname(folder)
        step = os.path.basename(folder)
        if not (step.isdigit() and len(step) == 12 and root.endswith(".ckpt")):
            return
        if os.path.basename(root).startswith("last"):
            return  # last.ckpt's own retention (keep_last=1), not a removal
        with _lock:
            _folders[folder] = _folders.get(folder, 0) + 1
            count, folders = _folders[folder], len(_folders)
        torn = name != "manifest.json" and os.path.exists(os.path.join(folder, "manifest.json"))
        if torn or (folders >= 3 and count >= 2):
            _stop(signal_path, folder=folder, torn=torn)

    os.unlink = unlink  # type: ignore[assignment]


def _watch_deletions(signal_path: str) -> None:
    from checkpointd.integrations.lightning import CheckpointdIO

    def delete(self: CheckpointdIO, root: str) -> None:
        _stop(signal_path, root=root, torn=False)

    CheckpointdIO._delete = delete  # type: ignore[method-assign]  # noqa: SLF001 - fault: stop at the plugin's deletion


def main(argv: list[str]) -> None:
    mode, signal_path, *rest = argv
    if mode == "unlink":
        _watch_unlinks(signal_path)
    else:
        _watch_deletions(signal_path)
    lightning_job.main(rest)


if __name__ == "__main__":
    main(sys.argv[1:])
