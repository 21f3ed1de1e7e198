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

What a save holds: component ``model`` (Lightning's ``state_dict``),
``optimizers`` (``optimizer_states``), ``trainer`` (every other key: loops,
callbacks, epoch, hyperparameters...) and ``rng`` (Python, NumPy, torch and
CUDA generators, which Lightning does not save); nothing is pickled, an
unstorable value raises UnsupportedValueError on the training thread.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shutil
import warnings
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from checkpointd.capture import StagingBuffer
from checkpointd.catalog import list_checkpoints
from checkpointd.errors import CheckpointWarning, InvalidArgumentError
from checkpointd.handle import SaveHandle
from checkpointd.restore import load
from checkpointd.rng import RNGState
from checkpointd.service import WriteService
from checkpointd.writer import CheckpointWriter

__all__ = ["CheckpointdIO", "checkpoint_root", "last_checkpoint"]

_BASE_MODULES = (
    "lightning_fabric.plugins.io.checkpoint_io",
    "lightning.fabric.plugins.io.checkpoint_io",
)
_MODEL, _OPTIMIZERS = "model", "optimizers"
_REST = "trainer"
_RNG = "rng"
# Retention is ModelCheckpoint's job (save_top_k); a root keeps its newest step only.
# Writers kept open, most recently saved roots first: a root saved again by the same
# writer lets retention drop its older step at once (another writer's fresh commits
# are kept for a grace window); ``last.ckpt`` is saved every time and stays open.
_OPEN_WRITERS = 4
_LAST = re.compile(r"^last(-v?\d+)?\.ckpt$")  # ModelCheckpoint's last.ckpt, last-v1.ckpt
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
            "checkpointd.lightning needs pytorch-lightning or lightning: pip install pytorch-lightning"
        )
    return tuple(found)


if TYPE_CHECKING:
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO as _Base
else:
    _found = _bases()
    _Base = _found[0] if len(_found) == 1 else type("_CheckpointIOBases", _found, {})


def checkpoint_root(path: str | os.PathLike[str]) -> str:
    """The checkpointd root a Lightning checkpoint path stands for: a URL as is, a
    local path made absolute with symlinks resolved."""
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        return text
    text = text.removeprefix("file://")
    return os.path.realpath(text)


def last_checkpoint(
    dirpath: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
) -> str | None:
    """The ``last*.ckpt`` root under ``dirpath`` committed most recently, as a path or URL
    for ``Trainer.fit(ckpt_path=...)``; None if there is none.

    For S3 and other URLs, where ``ckpt_path="last"`` finds nothing: Lightning lists
    ``dirpath`` with its own filesystem and drops the ``s3://`` of what it finds, then
    looks for those names on the local disk. Called from any thread."""
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


class _PooledWriter(CheckpointWriter):
    """A CheckpointWriter whose staging buffers come from, and go back to, a shared pool.

    Each top-k path is a root of its own, so Lightning's saves go to a new writer
    almost every time; a fresh buffer would cost a first touch of every page of
    the snapshot on the training thread. The pool hands a closed writer's warm
    buffers to the next one (a writer holds them only while it is open)."""

    def __init__(self, root: str, pool: list[StagingBuffer], **options: Any) -> None:
        self._pool = pool
        super().__init__(root, **options)

    def _start(self) -> None:
        """Swap the service's new buffers for pooled ones before its loop starts."""
        assert isinstance(self._service, WriteService)  # never through the checkpoint service
        buffers = self._service._buffers
        for i in range(len(buffers)):
            if self._pool:
                buffers[i] = self._pool.pop()
        super()._start()

    def close(self) -> None:
        """Close, then give the (now idle) buffers back to the pool."""
        try:
            super().close()
        finally:
            assert isinstance(self._service, WriteService)
            self._pool.extend(self._service._buffers)
            self._service._buffers = []


class CheckpointdIO(_Base):
    """Saves Lightning checkpoints in the background with checkpointd, durably.

    ``writer_options`` go to each ``CheckpointWriter`` (``storage_options`` for
    S3, ``max_pending``, ``max_concurrency``, ``background_niceness``...);
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

    def __init__(self, *, restore_rng: bool = True, **writer_options: Any) -> None:
        refused = [name for name in _REFUSED if name in writer_options]
        if refused:
            raise InvalidArgumentError(
                f"CheckpointdIO takes no {', '.join(refused)}: ModelCheckpoint's save_top_k and "
                "save_last decide which checkpoints are kept"
            )
        super().__init__()
        self.restore_rng = restore_rng
        self.writer_options = dict(writer_options)
        self._storage_options: Mapping[str, Any] | None = writer_options.get("storage_options")
        self._writers: dict[str, CheckpointWriter] = {}
        self._buffers: list[StagingBuffer] = []
        # Deleting a removed root (and closing its writer) runs off the training thread.
        self._deleter: ThreadPoolExecutor | None = None
        self._deleting: dict[str, Future[None]] = {}
        self._last_step: dict[str, int] = {}
        self._handles: list[tuple[str, SaveHandle]] = []
        self._removals: list[tuple[str, list[SaveHandle]]] = []

    # -- Lightning's interface ------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Snapshot ``checkpoint`` into the root ``path`` and return; it is written in the
        background. Raises at once for an unstorable value or a background error not yet
        seen."""
        if storage_options is not None:
            raise InvalidArgumentError(
                "CheckpointdIO takes storage options once: CheckpointdIO(storage_options=...)"
            )
        self._settle()
        root = checkpoint_root(path)
        self._deleted(root)
        writer = self._writer(root)
        step = _step_of(checkpoint)
        newest = self._last_step.get(root)
        if newest is not None and step <= newest:
            step = newest + 1
        state: dict[str, Any] = {_REST: {}}
        for key, value in checkpoint.items():
            if key == "state_dict":
                state[_MODEL] = value
            elif key == "optimizer_states":
                state[_OPTIMIZERS] = {"optimizer_states": value}
            else:
                state[_REST][key] = value
        state[_RNG] = RNGState()
        metadata = {"lightning_path": os.fspath(path), "global_step": _step_of(checkpoint)}
        handle = writer.save(step, state, metadata=metadata)
        self._last_step[root] = step
        self._handles.append((root, handle))

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The dict saved last under ``path`` (tensors on CPU, or on ``map_location`` when
        it is a device or device string); sets the RNG state when ``restore_rng``.
        ``weights_only`` is accepted and moot: nothing is unpickled. Raises
        CheckpointNotFoundError if nothing is committed there."""
        root = checkpoint_root(path)
        self._deleted(root)
        self._wait_for(root)
        where = map_location if isinstance(map_location, str | torch.device) else None
        loaded = load(root, storage_options=self._storage_options, map_location=where)
        checkpoint: dict[str, Any] = dict(loaded.state[_REST])
        if _MODEL in loaded.state:
            checkpoint["state_dict"] = loaded.state[_MODEL]
        if _OPTIMIZERS in loaded.state:
            checkpoint["optimizer_states"] = loaded.state[_OPTIMIZERS]["optimizer_states"]
        if self.restore_rng and _RNG in loaded.state:
            RNGState().load_state_dict(loaded.state[_RNG])
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the root ``path`` once every save made before this call is committed
        (a symlink, as ``save_last="link"`` makes, is removed at once, not its target)."""
        text = os.fspath(path)
        if "://" not in text and os.path.islink(text):
            os.remove(text)
            return
        root = checkpoint_root(path)
        waiting = [handle for _, handle in self._handles if not handle.done()]
        self._removals.append((root, waiting))
        self._settle()

    def teardown(self) -> None:
        """Wait for every save, run the deferred removals, close the writers; raise the
        first save error."""
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
            writer = _PooledWriter(root, self._buffers, keep_last=1, **self.writer_options)
            newest = writer._service.newest
            if newest is not None:
                self._last_step[root] = max(newest, self._last_step.get(root, newest))
        self._writers[root] = writer
        return writer

    def _wait_for(self, root: str) -> None:
        writer = self._writers.get(root)
        if writer is not None:
            writer.wait()

    def _settle(self) -> None:
        """Close idle writers beyond the ``_OPEN_WRITERS`` most recently used (each is a
        thread), then run every removal whose earlier saves are all resolved."""
        self._handles = [(root, h) for root, h in self._handles if not h.done()]
        for root in [root for root, future in self._deleting.items() if future.done()]:
            self._deleted(root)  # raises a failed deletion's error
        busy = {root for root, _ in self._handles}
        for root in list(self._writers)[: max(0, len(self._writers) - _OPEN_WRITERS)]:
            if root not in busy:
                self._writers.pop(root).close()
        ready = [(root, hs) for root, hs in self._removals if all(h.done() for h in hs)]
        self._removals = [item for item in self._removals if item not in ready]
        for root, handles in ready:
            failed = [h.step for h in handles if h._error is not None]
            if failed:
                warnings.warn(
                    f"kept {root}: Lightning removed it, but a newer save (step "
                    f"{', '.join(map(str, failed))}) failed",
                    CheckpointWarning,
                    stacklevel=3,
                )
                continue
            self._deleted(root)
            writer = self._writers.pop(root, None)
            if writer is not None:
                writer.close()  # idle (its saves are done): quick, and its buffer is free again
            self._last_step.pop(root, None)
            if self._deleter is None:
                self._deleter = ThreadPoolExecutor(1, thread_name_prefix="checkpointd-lightning")
            self._deleting[root] = self._deleter.submit(self._delete, root)

    def _deleted(self, root: str) -> None:
        """Wait until a background deletion of ``root`` (if any) is over; raise its error."""
        future = self._deleting.pop(root, None)
        if future is not None:
            future.result()

    def _delete(self, root: str) -> None:
        """Delete the root; on the deletion thread."""
        if "://" not in root:
            if os.path.isdir(root) and not os.path.islink(root):
                shutil.rmtree(root, ignore_errors=False)
            elif os.path.lexists(root):
                os.remove(root)
            return
        import fsspec

        fs, target = fsspec.core.url_to_fs(root, **(self._storage_options or {}))
        if fs.exists(target):
            fs.rm(target, recursive=True)


def _step_of(checkpoint: Mapping[str, Any]) -> int:
    step = checkpoint.get("global_step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidArgumentError(f"checkpoint['global_step'] must be an int >= 0, not {step!r}")
    return step
