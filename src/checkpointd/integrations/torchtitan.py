"""CheckpointdManager: a torchtitan checkpoint manager that saves through checkpointd.

Beside torchtitan's DCP ``CheckpointManager``, selected by configuration: the
trainer builds whatever ``Trainer.Config.checkpoint`` is, so::

    from checkpointd.integrations.torchtitan import CheckpointdManager

    config.checkpoint = CheckpointdManager.Config(enable=True, interval=500, keep_latest_k=3,
                                                  folder="s3://bucket/run",          # or relative
                                                  storage_options={...})

Every rank calls ``save``/``load`` (the trainer does); saves are one collective
checkpointd checkpoint through the default process group: the model's and the
optimizer's DTensors are stored as shards (each distinct shard once) and
restore reshards to another data-parallel size; ``lr_scheduler`` and
``train_state`` are replicated (ranks must agree); ``dataloader`` and ``rng`` (the
process's Python, NumPy, torch, CUDA generators, which torchtitan's DCP manager
does not save) are per rank, and skipped with a warning when the world size
changed (torchtitan's DCP manager has the same limit for the dataloader).

Against the DCP manager: ``save`` returns once the state is copied to host
memory (DCP's ``async_mode`` needs a process group of its own and still pickles
its metadata); the commit is atomic (a step folder without its manifest is never
loaded); ``keep_latest_k`` deletes only after a newer checkpoint is durable;
nothing is pickled; S3 and any fsspec store through ``storage_options``. Same
policy fields: ``interval``, ``enable_first_step_checkpoint``, ``load_step``,
``exclude_from_loading``, ``load_only``, ``last_save_model_only`` (with
``export_dtype``), ``initial_load_path`` (a checkpointd root) and
``initial_load_model_only``. Not supported: ``last_save_in_hf`` and
``initial_load_in_hf`` (ValueError), pipeline-parallel model parts saved
separately (they are flattened into one ``model`` component, as DCP does).

Importing this module imports torchtitan; ``import checkpointd`` does not.
Call from the training thread of every rank.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torchtitan.components.checkpointer import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)

from checkpointd.api.restore import restore
from checkpointd.api.writer import CheckpointWriter
from checkpointd.errors import CheckpointWarning
from checkpointd.ranks.group import PerRank
from checkpointd.read.catalog import list_checkpoints
from checkpointd.state.rng import RNGState
from checkpointd.write.handle import SaveHandle
from checkpointd.write.options import WriterOptions

__all__ = ["CheckpointdManager"]

RNG = "rng"
_PER_RANK = (DATALOADER, RNG)


class _Plain:
    """A Stateful that hides what it wraps (an ``Optimizer`` subclass, a wrapper of modules).

    So its own ``state_dict`` (torchtitan's FQN-keyed, flattened one) is what is stored
    and its own ``load_state_dict`` what restores it.
    """

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> Any:
        return self.obj.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.obj.load_state_dict(state)


class CheckpointdManager(BaseCheckpointManager):  # type: ignore[misc]
    """torchtitan's checkpoint manager contract, over a checkpointd writer (see module)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):  # type: ignore[misc]
        """torchtitan's checkpoint options, and the writer's own below them."""

        storage_options: dict[str, Any] = field(default_factory=dict)
        """fsspec options of the folder (S3 credentials, endpoint...)."""

        max_pending: int = 1
        """Snapshots held in host memory at once (a save waits for a free one)."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            if self.last_save_in_hf or self.initial_load_in_hf:
                raise ValueError(
                    "CheckpointdManager does not read or write Hugging Face safetensors "
                    "(last_save_in_hf, initial_load_in_hf): use `checkpointd export --format hf`"
                )
            self.writer_options()  # InvalidArgumentError for a bad option, here and now

        def writer_options(self) -> WriterOptions:
            """The options of the manager's writer, from this config (checked)."""
            return WriterOptions(
                storage_options=dict(self.storage_options) or None,
                keep_last=self.keep_latest_k or None,
                max_pending=self.max_pending,
            )

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        """What torchtitan's trainer passes its checkpoint manager.

        Args:
            config: The checkpoint options (``[checkpoint]`` of the job config).
            dataloader: The training dataloader (a Stateful, saved per rank).
            model_parts: The model's parts (pipeline stages).
            optimizers: torchtitan's optimizers container.
            lr_schedulers: torchtitan's schedulers container.
            states: Further components to save (``train_state``...).
            sd_adapter: Accepted for torchtitan's contract; not used.
            base_folder: The job's dump folder, which a local ``config.folder`` is
                relative to.
        """
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future = None  # the writer's handles stand for DCP's futures
        folder = config.folder
        remote = "://" in folder
        self.folder = folder if remote or not base_folder else os.path.join(base_folder, folder)
        self.config = config
        self.states: dict[str, Any] = dict(states)
        self.states.update(
            {
                MODEL: _Plain(ModelWrapper(model_parts)),
                OPTIMIZER: _Plain(optimizers),
                LR_SCHEDULER: lr_schedulers,
            }
        )
        if dataloader is not None:
            self.states[DATALOADER] = PerRank(dataloader)
        self.states[RNG] = PerRank(RNGState())
        self.model = ModelWrapper(model_parts)
        self.export_dtype = getattr(torch, config.export_dtype)
        self._writer: CheckpointWriter | None = None
        self._handles: list[SaveHandle] = []

    def __del__(self) -> None:
        self.close()

    @property
    def storage_options(self) -> dict[str, Any] | None:
        """The fsspec options of ``folder`` (None: none)."""
        return dict(self.config.storage_options) or None

    def writer(self) -> CheckpointWriter:
        """The writer of ``folder``, opened on the first save.

        Returns:
            The manager's writer.

        Raises:
            InvalidArgumentError: A writer option out of range.
        """
        if self._writer is None:
            options = self.config.writer_options()
            self._writer = CheckpointWriter(self.folder, **options.keywords())
        return self._writer

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if self.config.load_only:
            return False
        if curr_step == 1 and self.config.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.config.interval == 0

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Snapshot the state at ``curr_step`` if the policy says so.

        Returns after the copy (written, committed and pruned in the background).
        """
        if not self._should_save(curr_step, last_step):
            return False
        if last_step and self.config.last_save_model_only:
            weights = {
                k: v.to(self.export_dtype)
                if isinstance(v, torch.Tensor) and v.is_floating_point()
                else v
                for k, v in self.model.state_dict().items()
            }
            state: dict[str, Any] = {MODEL: weights}
            metadata = {"model_only": True}
        else:
            state, metadata = self.states, {"model_only": False}
        self._handles = [h for h in self._handles if not h.done()]
        self._handles.append(self.writer().save(curr_step, state, metadata=metadata))
        return True

    def _load(self, step: int = -1) -> bool:
        """Restore the newest committed checkpoint of ``folder`` (or ``step``).

        Else the ``initial_load_path`` root, else nothing (False: a fresh start).
        """
        root, model_only = self.folder, False
        infos = list_checkpoints(root, storage_options=self.storage_options)
        if step != -1 and step not in [i.step for i in infos]:
            raise FileNotFoundError(f"checkpoint.load_step={step} is not committed in {root}")
        if not infos:
            if not self.config.initial_load_path:
                return False
            root = self.config.initial_load_path
            infos = list_checkpoints(root, storage_options=self.storage_options)
            if not infos:
                raise FileNotFoundError(f"checkpoint.initial_load_path {root} holds no checkpoint")
            model_only = self.config.initial_load_model_only
        info = infos[-1] if step == -1 else next(i for i in infos if i.step == step)
        model_only = model_only or info.step == 0 or bool(info.metadata.get("model_only"))
        names = {MODEL} if model_only else set(self.states) - set(self.config.exclude_from_loading)
        targets = {k: v for k, v in self.states.items() if k in names}
        if model_only:
            targets = {MODEL: self.states[MODEL]}
        result = restore(
            root, targets, info.step, storage_options=self.storage_options, strict=False
        )
        unexpected = set(result.skipped_targets) - set(_PER_RANK)
        if unexpected:
            raise FileNotFoundError(
                f"checkpoint {info.path} has no {sorted(unexpected)} to restore into"
            )
        if result.skipped_targets:
            warnings.warn(
                f"checkpoint {info.path}: {sorted(result.skipped_targets)} not restored (saved "
                "by another number of ranks); the data order and random streams start afresh",
                CheckpointWarning,
                stacklevel=3,
            )
        return True

    def _maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: ``save`` returns after the copy."""

    def _wait_for_saving(self) -> None:
        """Wait for every pending save to be committed; raises its failure."""
        if self._writer is not None:
            self._writer.wait()

    def wait(self) -> None:
        """Wait for every pending save to be committed (raises the first failure)."""
        if self.enable:
            self._wait_for_saving()

    def _close(self) -> None:
        writer = getattr(self, "_writer", None)
        self._writer = None
        if writer is not None:
            writer.close()
