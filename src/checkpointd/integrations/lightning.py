"""CheckpointdIO: a Lightning ``CheckpointIO`` plugin that saves through checkpointd writers.

``Trainer(plugins=[CheckpointdIO()])`` and nothing else changes. Works with
``pytorch_lightning`` and ``lightning.pytorch`` (the plugin subclasses the
``CheckpointIO`` of every one installed); importing this module imports them,
``import checkpointd`` does not.

Paths. Each checkpoint path Lightning asks for (``dirpath/epoch=1-step=100.ckpt``,
``last.ckpt``, ``s3://bucket/run/last.ckpt``) is a checkpointd root: a folder of
that name holding step folders, of which only the newest committed one is kept
(``keep_last=1``: the older one is deleted once the newer is durable). The step
is Lightning's ``global_step``, or one more than the root's newest step when a
path is saved again at the same global step. Loading a path loads the newest
committed step of its root, so ``ckpt_path="last"`` and ``ckpt_path=<path>``
work unchanged, and ``checkpointd ls <path>`` shows it. A local path is
resolved through symlinks (``ModelCheckpoint(save_last="link")`` links
``last.ckpt`` to the newest top-k folder).

S3 and other URLs. ``CheckpointdIO(storage_options=...)`` reaches the store for
saves, loads and removals; ``ModelCheckpoint`` itself opens ``dirpath`` with no
options, so give s3fs the same settings through its environment
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``,
``AWS_DEFAULT_REGION``). ``ckpt_path="last"`` finds nothing on S3 (Lightning drops
the ``s3://`` of what it lists): resume with
``ckpt_path=last_checkpoint(dirpath, storage_options=...)``.

Cost. Top-k paths are new roots, so most saves open a new writer; the writers
share their staging buffers (a warm buffer needs no page faults on the training
thread) and removed roots are deleted on a background thread.

Removal is removal.py's: recorded at the root first, deleted manifest first, and
finished by the next run (or ``checkpointd gc DIRPATH --apply``) if a kill cuts it short.

What a save holds: component ``model`` (Lightning's ``state_dict``),
``optimizers`` (``optimizer_states``), ``trainer`` (every other key: loops,
callbacks, epoch, hyperparameters...) and ``rng`` (Python, NumPy, torch and
CUDA generators, which Lightning does not save), mapped in lightning_state.py;
nothing is pickled, an unstorable value raises UnsupportedValueError on the
training thread.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Unpack

import torch

from checkpointd import tunables
from checkpointd.api.writer import CheckpointWriter
from checkpointd.errors import CheckpointWarning, InvalidArgumentError
from checkpointd.integrations.lightning_paths import checkpoint_root, last_checkpoint
from checkpointd.integrations.lightning_state import checkpoint_of, components_of, step_of
from checkpointd.maintain.removal import (
    Awaited,
    due,
    mark_root,
    pending_removals,
    remove_root,
    unmark_root,
)
from checkpointd.read.restore import load
from checkpointd.write.capture import BufferPool
from checkpointd.write.handle import SaveHandle
from checkpointd.write.options import WriterKeywords, WriterOptions

__all__ = ["CheckpointdIO", "checkpoint_root", "last_checkpoint"]

_BASE_MODULES = (
    "lightning_fabric.plugins.io.checkpoint_io",
    "lightning.fabric.plugins.io.checkpoint_io",
)
# Retention is ModelCheckpoint's job (save_top_k); a root keeps its newest step only.
# Writers kept open, most recently saved roots first: a root saved again by the same
# writer lets retention drop its older step at once (another writer's fresh commits
# are kept for a grace window); ``last.ckpt`` is saved every time and stays open.
_REFUSED = ("keep_last", "keep_every", "keep_best", "best_metric", "best_mode", "retention")


def _bases() -> tuple[type, ...]:
    """The CheckpointIO base class of every installed Lightning flavour."""
    found = []
    for name in _BASE_MODULES:
        top = name.partition(".")[0]
        if importlib.util.find_spec(top) is not None:
            found.append(importlib.import_module(name).CheckpointIO)
    if not found:
        raise ImportError(
            "checkpointd.integrations.lightning needs pytorch-lightning or lightning: pip install pytorch-lightning"
        )
    return tuple(found)


if TYPE_CHECKING:
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO as _Base
else:
    _found = _bases()
    _Base = _found[0] if len(_found) == 1 else type("_CheckpointIOBases", _found, {})


class CheckpointdIO(_Base):
    """Saves Lightning checkpoints in the background with checkpointd, durably.

    ``writer_options`` go to each ``CheckpointWriter`` (``storage_options`` for
    S3, ``max_pending``, ``max_concurrency``, ``background_niceness``...; checked
    when the plugin is made, InvalidArgumentError);
    retention options are refused (``ModelCheckpoint(save_top_k=...)`` decides
    what is kept). ``restore_rng`` (default True): ``load_checkpoint`` sets the
    process's generators to the saved ones, so a resume continues the same random
    streams; it raises RestoreMismatchError if the devices differ (pass False to
    resume non-exactly).

    Lightning calls every method from the training thread of global rank 0:
    ``save_checkpoint`` returns once the state is copied (the training step may
    go on), ``remove_checkpoint`` deletes a path only once every save made
    before it is committed (if one of them failed, the path is kept and a
    CheckpointWarning says so), ``load_checkpoint`` first waits for pending saves,
    ``teardown`` waits for every save and raises the first error.
    """

    def __init__(
        self, *, restore_rng: bool = True, **writer_options: Unpack[WriterKeywords]
    ) -> None:
        """Check the writer options once; writers open as roots are first saved to.

        Args:
            restore_rng: Whether ``load_checkpoint`` sets the process's generators to the
                saved ones.
            **writer_options: ``CheckpointWriter`` options for every root (no retention).

        Raises:
            InvalidArgumentError: A retention option, or an option out of range.
        """
        refused = [name for name in _REFUSED if name in writer_options]
        if refused:
            raise InvalidArgumentError(
                f"CheckpointdIO takes no {', '.join(refused)}: ModelCheckpoint's save_top_k and "
                "save_last decide which checkpoints are kept"
            )
        if "buffer_pool" in writer_options:
            raise InvalidArgumentError(
                "CheckpointdIO takes no buffer_pool: its writers share one pool of their own"
            )
        super().__init__()
        self.restore_rng = restore_rng
        # Each top-k path is a root of its own, so saves go to a new writer almost every
        # time: the pool hands a closed writer's warm staging buffers to the next one
        # (fresh ones would cost a first touch of every page on the training thread).
        self.options = WriterOptions(**writer_options).replace(
            keep_last=1, buffer_pool=BufferPool()
        )
        """The options of every writer (checked here: InvalidArgumentError): keep_last=1
        and one shared buffer_pool, since each top-k path is a root of its own."""
        self._storage_options = self.options.storage_options
        self._writers: dict[str, CheckpointWriter] = {}
        # Deleting a removed root (and closing its writer) runs off the training thread.
        self._deleter: ThreadPoolExecutor | None = None
        self._deleting: dict[str, Future[None]] = {}
        self._last_step: dict[str, int] = {}
        self._handles: list[tuple[str, SaveHandle]] = []
        self._removals: list[tuple[str, list[SaveHandle]]] = []
        self._marked: set[str] = set()  # roots with a removal marker (removal.py)
        self._scanned: set[str] = set()  # folders whose interrupted removals were looked at

    # -- Lightning's interface ------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Snapshot ``checkpoint`` into the root ``path`` and return.

        It is written in the background.

        Args:
            checkpoint: Lightning's checkpoint dict.
            path: The checkpoint's path, a root of its own (a local path or URL).
            storage_options: Refused: storage options are the plugin's, given once.

        Raises:
            InvalidArgumentError: ``storage_options`` given here.
            UnsupportedValueError: A value cannot be stored.
            CheckpointError: A background error not yet seen.
        """
        if storage_options is not None:
            raise InvalidArgumentError(
                "CheckpointdIO takes storage options once: CheckpointdIO(storage_options=...)"
            )
        root = checkpoint_root(path)
        self._resume_removals(root)
        # Saved again: a removal Lightning asked for earlier is off.
        self._removals = [item for item in self._removals if item[0] != root]
        self._settle()
        self._deleted(root)
        if root in self._marked:  # removed once, saved again: the removal is off
            self._marked.discard(root)
            unmark_root(root, self._storage_options)
        writer = self._writer(root)
        step = step_of(checkpoint)
        newest = self._last_step.get(root)
        if newest is not None and step <= newest:
            step = newest + 1
        metadata = {"lightning_path": os.fspath(path), "global_step": step_of(checkpoint)}
        handle = writer.save(step, components_of(checkpoint), metadata=metadata)
        self._last_step[root] = step
        self._handles.append((root, handle))

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The dict saved last under ``path``.

        Tensors on CPU, or on ``map_location`` when it is a device or device string; sets
        the RNG state when ``restore_rng``.
        Pending saves are waited for first.

        Args:
            path: The checkpoint's path (its root).
            map_location: A device or device string for the tensors; None: CPU.
            weights_only: Accepted and moot: nothing is unpickled.

        Returns:
            The checkpoint dict as Lightning saved it.

        Raises:
            CheckpointNotFoundError: Nothing is committed there.
            RestoreMismatchError: The saved RNG state does not fit this process's devices
                (with ``restore_rng``).
        """
        root = checkpoint_root(path)
        self._resume_removals(root)
        self._deleted(root)
        self._wait_for(root)
        where = map_location if isinstance(map_location, str | torch.device) else None
        loaded = load(root, storage_options=self._storage_options, map_location=where)
        return checkpoint_of(loaded.state, restore_rng=self.restore_rng)

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the root ``path`` once every save made before this call is committed.

        A symlink, as ``save_last="link"`` makes, is removed at once, not its target.
        If a save made before failed, the path is kept and a CheckpointWarning says so.

        Args:
            path: The checkpoint's path (its root).
        """
        text = os.fspath(path)
        if "://" not in text and os.path.islink(text):
            os.remove(text)
            return
        root = checkpoint_root(path)
        self._resume_removals(root)
        pending = [(r, h) for r, h in self._handles if not h.done()]
        # Durable before this returns (training thread), so a kill cannot forget it.
        awaited = [Awaited(r, h.step) for r, h in pending if r != root]
        if mark_root(root, awaited, self._storage_options):
            self._marked.add(root)
        self._removals.append((root, [h for _, h in pending]))
        self._settle()

    def teardown(self) -> None:
        """Wait for every save, run the deferred removals, close the writers.

        Raises:
            CheckpointError: The first save error.
        """
        writers, self._writers = self._writers, {}
        errors: list[BaseException] = []
        for writer in writers.values():
            try:
                writer.close()
            except BaseException as exc:  # every writer is closed before one error is raised
                errors.append(exc)
        self._settle()
        self._handles.clear()
        for root in list(self._deleting):
            try:
                self._deleted(root)
            except BaseException as exc:
                errors.append(exc)
        if self._deleter is not None:
            self._deleter.shutdown()
            self._deleter = None
        if errors:
            raise errors[0]

    # -- bookkeeping ----------------------------------------------------------

    def _writer(self, root: str) -> CheckpointWriter:
        writer = self._writers.pop(root, None)  # re-inserted: the dict is in order of use
        if writer is None:
            writer = CheckpointWriter(root, **self.options.keywords())
            newest = writer.newest_step
            if newest is not None:
                self._last_step[root] = max(newest, self._last_step.get(root, newest))
        self._writers[root] = writer
        return writer

    def _wait_for(self, root: str) -> None:
        writer = self._writers.get(root)
        if writer is not None:
            writer.wait()

    def _settle(self) -> None:
        """Close idle writers, then run every removal whose earlier saves are all resolved.

        Idle writers beyond the ``tunables.LIGHTNING_OPEN_WRITERS`` most recently used
        are closed (each is a thread).
        """
        self._handles = [(root, h) for root, h in self._handles if not h.done()]
        for root in [root for root, future in self._deleting.items() if future.done()]:
            self._deleted(root)  # raises a failed deletion's error
        busy = {root for root, _ in self._handles}
        for root in list(self._writers)[
            : max(0, len(self._writers) - tunables.LIGHTNING_OPEN_WRITERS)
        ]:
            if root not in busy:
                self._writers.pop(root).close()
        ready = [(root, hs) for root, hs in self._removals if all(h.done() for h in hs)]
        self._removals = [item for item in self._removals if item not in ready]
        for root, handles in ready:
            failed = [h.step for h in handles if h.exception() is not None]
            self._deleted(root)
            if failed:
                warnings.warn(
                    f"kept {root}: Lightning removed it, but a newer save (step "
                    f"{', '.join(map(str, failed))}) failed",
                    CheckpointWarning,
                    stacklevel=3,
                )
                if root in self._marked:
                    self._marked.discard(root)
                    unmark_root(root, self._storage_options)
                continue
            writer = self._writers.pop(root, None)
            if writer is not None:
                writer.close()  # idle (its saves are done): quick, and its buffer is free again
            self._last_step.pop(root, None)
            self._marked.discard(root)
            self._background(root, self._delete)

    def _background(self, root: str, job: Any) -> None:
        """Run ``job(root)`` on the deletion thread; ``_deleted(root)`` waits for it."""
        if self._deleter is None:
            self._deleter = ThreadPoolExecutor(1, thread_name_prefix="checkpointd-lightning")
        self._deleting[root] = self._deleter.submit(job, root)

    def _resume_removals(self, root: str) -> None:
        """The first time a folder of roots is touched.

        Finish the removals a killed run left there whose saves are committed (in the background);
        note the others.
        """
        folder = root.rstrip("/").rpartition("/")[0] or "/"
        if folder in self._scanned:
            return
        self._scanned.add(folder)
        busy = {r for r, _ in self._removals} | set(self._deleting) | set(self._writers)
        for found, removal in pending_removals(folder, self._storage_options):
            if found in busy:
                continue
            self._marked.add(found)
            if due(removal, self._storage_options):
                self._marked.discard(found)
                self._background(found, self._delete)

    def _deleted(self, root: str) -> None:
        """Wait until a background deletion of ``root`` (if any) is over; raise its error."""
        future = self._deleting.pop(root, None)
        if future is not None:
            future.result()

    def _delete(self, root: str) -> None:
        """Delete the root (removal.delete_root: manifests first); on the deletion thread."""
        if "://" not in root and os.path.lexists(root) and not os.path.isdir(root):
            os.remove(root)  # a file or a dangling link, not a root
            return
        remove_root(root, self._storage_options)
