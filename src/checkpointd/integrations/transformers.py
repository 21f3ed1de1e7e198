"""CheckpointdTrainer: 🤗 transformers' ``Trainer`` saving and resuming through checkpointd.

One line: ``Trainer(...)`` becomes ``CheckpointdTrainer(...)`` (or, for a Trainer
subclass such as ``Seq2SeqTrainer``, ``class T(CheckpointdMixin, Seq2SeqTrainer)``)::

    from checkpointd.integrations.transformers import CheckpointdTrainer

    trainer = CheckpointdTrainer(model=model, args=args, train_dataset=data,
                                 checkpointd_root="s3://bucket/run",          # optional
                                 checkpointd_options={"storage_options": s3})  # optional
    trainer.train(resume_from_checkpoint=trainer.has_checkpoint())

Why a subclass, not a ``TrainerCallback``. Trainer decides where a resumed run
starts (``epochs_trained`` and the batches to skip, from ``TrainerState.global_step``)
in ``_init_training_state``, before any callback runs (``on_train_begin`` comes
after), and skips batches only when ``train`` was given a checkpoint path, which
it then reads as Trainer files (``trainer_state.json``, ``*.pth`` through
``torch.load``). A callback also runs ``on_save`` only after Trainer has written
its own pickled checkpoint. So the mixin overrides Trainer's checkpoint hooks
(``_save_checkpoint``, ``_init_training_state``, ``_load_optimizer_and_scheduler``,
``_load_scaler``, ``_load_rng_state``, ``_load_from_checkpoint``) and reuses its
own data-skipping: Trainer's mid-epoch resume logic runs unchanged.

Saving. At every save step Trainer decides (``save_strategy``, ``save_steps``,
the end of training), ``_save_checkpoint`` hands the state to a
``CheckpointWriter`` and returns once the tensors are copied; writing, upload,
the commit and retention run in the background. Trainer writes no
``checkpoint-N`` folder of its own (``trainer.save_model()`` still writes the
final model where you ask). ``save_total_limit`` becomes ``keep_last``, applied
after each commit only. ``train`` waits for the pending saves before it returns
and raises the first save failure. The root defaults to
``{output_dir}/checkpointd``; ``checkpointd ls`` reads it.

Components: ``model`` (the unwrapped model's state dict), ``optimizer``,
``scheduler``, ``scaler`` (when accelerate has a gradient scaler), ``rng``
(Python, NumPy, torch and CUDA generators), ``trainer_state`` (``TrainerState``
as a plain tree, callbacks' ``ExportableState`` included: the same content as
``trainer_state.json``) and ``loop`` (the loss accumulated since the last log,
so the first log after a resume reports what the uninterrupted run reports).
Nothing is pickled.

Resuming. ``train(resume_from_checkpoint=True)`` takes the newest committed
checkpoint of the root, an ``int`` that step, a ``str`` the newest of another
root, ``(root, step)`` that step of that root (rolling back into the same root
is refused: its newer steps would meet this run's saves). The data position is
Trainer's own (the batches of the interrupted epoch are skipped and the RNG is
restored after them, as Trainer does), which is exact with Trainer's default
seedable sampler and a collator that draws no random numbers. A checkpoint
saved with another batch size, gradient accumulation, seed or world size is
refused (RestoreMismatchError) before anything changes (transformers_resume.py).

Scope: one process (``world_size == 1``); DeepSpeed, FSDP, SageMaker MP and
``load_best_model_at_end`` are refused with InvalidArgumentError. Every method
is called by Trainer on its training thread.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from transformers import Trainer
from transformers.trainer_callback import ExportableState, TrainerState

from checkpointd.api.restore import restore
from checkpointd.api.writer import CheckpointWriter
from checkpointd.errors import InvalidArgumentError
from checkpointd.integrations.transformers_resume import (
    LOOP,
    MODEL,
    OPTIMIZER,
    RNG,
    SCALER,
    SCHEDULER,
    STATE,
    Applied,
    Resume,
    open_resume,
)
from checkpointd.read.catalog import list_checkpoints
from checkpointd.state.rng import RNGState
from checkpointd.storage import resolve_root
from checkpointd.write.options import WriterKeywords, WriterOptions

__all__ = ["CheckpointdMixin", "CheckpointdTrainer"]

# What decides the data position of a resumed run: it must be the same as when saved.
_POSITION_ARGS = ("per_device_train_batch_size", "gradient_accumulation_steps", "world_size")
_SEED_ARGS = ("seed", "data_seed")

if TYPE_CHECKING:
    _Base = Trainer
else:
    _Base = object


class CheckpointdMixin(_Base):
    """Put before a ``Trainer`` class: its checkpoints go through checkpointd.

    ``checkpointd_root``: where checkpoints go (a path or an fsspec URL; default
    ``{args.output_dir}/checkpointd``). ``checkpointd_options``: ``CheckpointWriter``
    options (``storage_options``, ``max_pending``, ``incremental``...; a
    retention option given here replaces ``save_total_limit``), checked when the
    Trainer is made (InvalidArgumentError). Everything else goes to the Trainer class.
    """

    def __init__(
        self,
        *args: Any,
        checkpointd_root: str | os.PathLike[str] | None = None,
        checkpointd_options: WriterKeywords | None = None,
        **kwargs: Any,
    ) -> None:
        """Make the Trainer, then check the writer options.

        Args:
            *args: The Trainer class's positional arguments.
            checkpointd_root: Where checkpoints go (a path or an fsspec URL; default
                ``{args.output_dir}/checkpointd``).
            checkpointd_options: ``CheckpointWriter`` options (a retention option given
                here replaces ``save_total_limit``).
            **kwargs: The Trainer class's keyword arguments.

        Raises:
            InvalidArgumentError: A writer option is out of range or of the wrong kind.
        """
        super().__init__(*args, **kwargs)
        options = WriterOptions(**(checkpointd_options or {}))
        if not any(k.startswith("keep_") or k == "retention" for k in checkpointd_options or {}):
            options = options.replace(keep_last=self.args.save_total_limit)
        self.checkpointd_options = options
        """The writer's options, checked here (InvalidArgumentError)."""
        root = checkpointd_root or os.path.join(self.args.output_dir or ".", "checkpointd")
        self.checkpointd_root = resolve_root(root)
        """The root, resolved now: a relative one is under this process's working folder
        (also through the checkpoint service, and after a later chdir)."""
        self._checkpointd_writer: CheckpointWriter | None = None
        self._checkpointd_resume: Resume | None = None

    # --- public ---

    @property
    def storage_options(self) -> Mapping[str, Any] | None:
        """The fsspec options of the root (from ``checkpointd_options``)."""
        return self.checkpointd_options.storage_options

    def has_checkpoint(self) -> bool:
        """Whether the root holds a committed checkpoint.

        ``train(resume_from_checkpoint= trainer.has_checkpoint())`` resumes when there is one and
        starts fresh otherwise.

        Returns:
            True if ``checkpointd_root`` holds one.
        """
        return bool(list_checkpoints(self.checkpointd_root, storage_options=self.storage_options))

    def train(
        self,
        resume_from_checkpoint: bool | int | str | tuple[str, int] | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> Any:
        """Trainer's ``train``, resuming from a checkpointd checkpoint.

        Waits for every pending save before it returns.

        Args:
            resume_from_checkpoint: True for the newest committed checkpoint of the root,
                an int for that step (refused if newer ones exist there), a str for the
                newest of that root, ``(root, step)`` for that step of that root; None or
                False: a fresh start.
            trial: As Trainer's.
            ignore_keys_for_eval: As Trainer's.

        Returns:
            Trainer's ``TrainOutput``.

        Raises:
            CheckpointError: The first save failure (after the training's own error, if
                it failed); what restoring the checkpoint raises.
        """
        self._refuse_unsupported()
        self._checkpointd_resume = None
        if resume_from_checkpoint is not None and resume_from_checkpoint is not False:
            self._checkpointd_resume = open_resume(
                resume_from_checkpoint,
                root=self.checkpointd_root,
                storage_options=self.storage_options,
                position_args=self._position_args(),
            )
        try:
            output = super().train(
                resume_from_checkpoint=None, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval
            )
        except BaseException:
            self._close_writer(raise_errors=False)
            raise
        finally:
            self._checkpointd_resume = None
        self._close_writer(raise_errors=True)
        return output

    # --- saving ---

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Snapshot the training state at ``state.global_step``.

        Writing runs in the background. Replaces Trainer's own checkpoint folder.
        """
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        stateful: Any = self.state.stateful_callbacks  # a dict by name, once built
        for callback in [*self.callback_handler.callbacks, self.control]:
            if isinstance(callback, ExportableState):  # as Trainer's _save_checkpoint does
                name = type(callback).__name__
                if isinstance(stateful[name], list):
                    stateful[name].append(callback.state())
                else:
                    stateful[name] = callback.state()
        state = {
            **self._trained_objects(),
            RNG: RNGState(),
            STATE: json.loads(json.dumps(dataclasses.asdict(self.state))),
            LOOP: {
                "tr_loss": self._tr_loss.detach(),
                "globalstep_last_logged": int(self._globalstep_last_logged),
            },
        }
        self._writer().save(
            self.state.global_step, state, metadata={"transformers_args": self._position_args()}
        )

    def _trained_objects(self) -> dict[str, Any]:
        """The model, optimizer, scheduler and scaler (if any), as live objects."""
        state: dict[str, Any] = {
            MODEL: self.model,
            OPTIMIZER: getattr(self.optimizer, "optimizer", self.optimizer),
            SCHEDULER: getattr(self.lr_scheduler, "scheduler", self.lr_scheduler),
        }
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            state[SCALER] = scaler
        return state

    def _writer(self) -> CheckpointWriter:
        if self._checkpointd_writer is None:
            self._checkpointd_writer = CheckpointWriter(
                self.checkpointd_root, **self.checkpointd_options.keywords()
            )
        return self._checkpointd_writer

    def _close_writer(self, *, raise_errors: bool) -> None:
        writer, self._checkpointd_writer = self._checkpointd_writer, None
        if writer is None:
            return
        try:
            writer.close()
        except Exception:
            if raise_errors:
                raise

    def _position_args(self) -> dict[str, Any]:
        return {name: getattr(self.args, name) for name in (*_POSITION_ARGS, *_SEED_ARGS)}

    # --- resuming ---

    def _inner_training_loop(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer's loop, told to resume (so it skips the batches already trained)."""
        if self._checkpointd_resume is not None:
            kwargs["resume_from_checkpoint"] = self._checkpointd_resume.marker
        return super()._inner_training_loop(*args, **kwargs)

    def _init_training_state(
        self,
        max_steps: int,
        num_update_steps_per_epoch: int,
        num_train_epochs: int,
        resume_from_checkpoint: str | None,
        trial: Any,
    ) -> tuple[int, int]:
        """Trainer's fresh state, or the saved ``TrainerState``.

        Returns the epochs done and the batches of the current epoch done, as Trainer computes them.
        """
        epochs, batches = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, None, trial
        )
        resume = self._checkpointd_resume
        if resume is None or resume_from_checkpoint != resume.marker:
            return int(epochs), int(batches)
        from transformers.trainer_utils import compare_trainer_and_checkpoint_args

        self.state = TrainerState(**resume.trees[STATE])
        self.state.best_model_checkpoint = None
        if self.args.auto_find_batch_size and self.state.train_batch_size is not None:
            self._train_batch_size = self.state.train_batch_size
        compare_trainer_and_checkpoint_args(self.args, self.state)  # type: ignore[no-untyped-call]
        self._load_callback_state()
        epochs = self.state.global_step // num_update_steps_per_epoch
        batches = 0
        if not self.args.ignore_data_skip:
            batches = self.state.global_step % num_update_steps_per_epoch
            batches *= self.args.gradient_accumulation_steps
        self.state.init_training_references(  # type: ignore[no-untyped-call]
            self, max_steps, num_train_epochs, trial
        )
        return epochs, batches

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Restore the model, optimizer, scheduler and scaler, all or nothing."""
        resume = self._checkpointd_resume
        if resume is None or checkpoint != resume.marker:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        targets = self._trained_objects()
        for name in (RNG, STATE, LOOP):  # already taken by open_resume
            targets[name] = Applied()
        restore(
            resume.root,
            targets,
            resume.info.step,
            storage_options=self.storage_options,
        )

    def _load_scaler(self, checkpoint: str | None) -> None:
        if self._checkpointd_resume is None or checkpoint != self._checkpointd_resume.marker:
            super()._load_scaler(checkpoint)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if (
            self._checkpointd_resume is None
            or resume_from_checkpoint != self._checkpointd_resume.marker
        ):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """Set the generators (and the loss accumulated since the last log) to the saved ones.

        Where Trainer sets its own: after skipping the batches already trained.
        """
        resume = self._checkpointd_resume
        if resume is None or checkpoint != resume.marker:
            super()._load_rng_state(checkpoint)
            return
        RNGState().load_state_dict(resume.trees[RNG])
        loop = resume.trees[LOOP]
        self._tr_loss.copy_(torch.as_tensor(loop["tr_loss"]))
        self._globalstep_last_logged = int(loop["globalstep_last_logged"])

    def _refuse_unsupported(self) -> None:
        why = [
            name
            for name, on in (
                ("DeepSpeed", self.is_deepspeed_enabled),
                ("FSDP", self.is_fsdp_enabled or bool(self.is_fsdp_xla_enabled)),
                ("load_best_model_at_end", self.args.load_best_model_at_end),
                (f"world_size {self.args.world_size}", self.args.world_size > 1),
            )
            if on
        ]
        if why:
            raise InvalidArgumentError(
                f"checkpointd.integrations.transformers supports one process without DeepSpeed or FSDP; "
                f"this Trainer has {', '.join(why)}"
            )


class CheckpointdTrainer(CheckpointdMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints go through checkpointd (see the module)."""
