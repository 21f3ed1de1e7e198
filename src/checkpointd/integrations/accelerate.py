"""Save and restore everything an ``accelerate.Accelerator`` knows, with a checkpointd writer.

The checkpointd counterpart of ``accelerator.save_state``/``load_state``::

    from checkpointd.integrations.accelerate import load_state, rest_of_epoch, save_state

    with CheckpointWriter("s3://bucket/run", keep_last=3) as writer:  # background, durable
        done = 0                                                # batches trained, all epochs
        if writer.list_checkpoints():
            done = load_state(accelerator, writer).metadata["done"]  # all or nothing
        while done < epochs * len(loader):
            in_epoch = done % len(loader)   # epoch done // len(loader): the loader agrees
            batches = rest_of_epoch(accelerator, loader, in_epoch) if in_epoch else loader
            for batch in batches:
                ...                                             # one training step
                done += 1
                if done % save_every == 0:
                    save_state(accelerator, writer, done, metadata={"done": done})

Components (one per object, in ``prepare`` order): ``model_0``...,
``optimizer_0``..., ``scheduler_0``..., ``dataloader_0``... (the sampler's
position: a ``SeedableRandomSampler``'s seed and epoch, else its generator),
``custom_0``... (``register_for_checkpointing``), ``scaler`` (the gradient
scaler, when there is one), ``accelerator`` (its step counter) and ``rng`` (the
process's Python, NumPy, torch and CUDA generators). Nothing is pickled.
Restore is strict: a missing or unexpected object, a shape or a device count
that does not fit raises RestoreMismatchError before anything changes (accelerate
itself logs a failed RNG restore at INFO and goes on).

Resume: a dataloader's position is the epoch of its next batch, so a save on an
epoch's last batch restores it at the next epoch, as ``done // len(loader)`` says.
Mid-epoch, the batches of the interrupted epoch come back in the same order with
``DataLoaderConfiguration(use_seedable_sampler=True)`` (the order is a function of
seed and epoch); skip the batches already seen with ``rest_of_epoch``. A plain
sampler's generator is restored as saved, which repeats the order exactly when
saved between epochs.

Several processes (``accelerate launch``, torchrun; accelerate sets up the
process group): every process calls ``save_state`` and ``load_state`` with the
same step, through a writer made after the ``Accelerator`` (its default
``process_group=None`` is the job's group): one collective checkpoint, whose
``rng`` is each process's own (restored per rank) and whose other components are
replicated (written once, and checked equal on every process). Give the
dataloaders one shuffle order on every process
(``DataLoaderConfiguration(data_seed=...)``, or the same seed before ``prepare``):
their positions are replicated too. Calling it on the main process only fails
with an error naming the ranks that did not join (a writer made with
``process_group=checkpointd.LOCAL`` saves that process alone). On a machine
without GPUs, ``accelerate launch --multi_gpu --num_processes 2`` (or ``torchrun
--nproc_per_node 2``) starts two processes, each a ``MULTI_CPU`` accelerator over
gloo; ``accelerate launch --cpu --num_processes 2`` starts one (accelerate runs
``--cpu`` jobs through its single-process launcher unless given an MPI host file).
Call from the training thread.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from checkpointd.api.restore import restore
from checkpointd.api.writer import CheckpointWriter
from checkpointd.errors import RestoreMismatchError
from checkpointd.integrations.accelerate_prepared import on_last_batch, prepared
from checkpointd.read.restore import RestoreInfo
from checkpointd.state.rng import RNGState
from checkpointd.write.handle import SaveHandle

__all__ = ["accelerator_state", "load_state", "rest_of_epoch", "save_state"]


_END = object()

_iterating: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
"""A prepared dataloader -> the loader ``rest_of_epoch`` iterates in its place."""


class _Counter:
    """The accelerator's own counters, as a Stateful."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        return {"step": int(self.accelerator.step)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.accelerator.step = int(state["step"])


class _SamplerPosition:
    """Where a prepared dataloader is (its epoch, its sampler's seed or generator), as a Stateful."""

    def __init__(self, dataloader: Any) -> None:
        from accelerate.data_loader import get_sampler  # type: ignore[import-untyped]

        self.dataloader = dataloader
        self.sampler = get_sampler(dataloader)

    def state_dict(self) -> dict[str, Any]:
        from accelerate.data_loader import SeedableRandomSampler

        sampler = self.sampler
        # "iteration": the epoch of the next batch. Saved on an epoch's last batch, the
        # loader still counts that epoch (it moves on when asked for one more batch):
        # restored as is, the next loop would draw that epoch's order again.
        epoch = int(getattr(self.dataloader, "iteration", 0))
        if on_last_batch(_iterating.get(self.dataloader, self.dataloader)):
            epoch += 1
        state: dict[str, Any] = {"iteration": epoch}
        if isinstance(sampler, SeedableRandomSampler):
            state["initial_seed"] = int(sampler.initial_seed)
        else:
            generator = getattr(sampler, "generator", None)
            if isinstance(generator, torch.Generator):
                state["generator"] = generator.get_state()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        now = self.state_dict()
        if set(now) != set(state):
            raise RestoreMismatchError(
                f"dataloader sampler state has {sorted(state)}, this sampler "
                f"({type(self.sampler).__name__}) has {sorted(now)}"
            )
        if "initial_seed" in state:
            self.sampler.initial_seed = int(state["initial_seed"])
        if "generator" in state:
            self.sampler.generator.set_state(state["generator"])
        if hasattr(self.dataloader, "set_epoch"):
            self.dataloader.set_epoch(int(state["iteration"]))


def accelerator_state(accelerator: Any) -> dict[str, Any]:
    """The components ``save_state`` saves and ``load_state`` restores, by name.

    As live objects: models unwrapped, optimizers and schedulers the wrapped torch ones.

    Args:
        accelerator: The ``Accelerator`` whose prepared objects are saved.

    Returns:
        Component name -> live object, the state ``CheckpointWriter.save`` takes.
    """
    state: dict[str, Any] = {}
    objects = prepared(accelerator)
    for i, model in enumerate(objects.models):
        state[f"model_{i}"] = accelerator.unwrap_model(model)
    for i, optimizer in enumerate(objects.optimizers):
        state[f"optimizer_{i}"] = getattr(optimizer, "optimizer", optimizer)
    for i, scheduler in enumerate(objects.schedulers):
        state[f"scheduler_{i}"] = getattr(scheduler, "scheduler", scheduler)
    for i, dataloader in enumerate(objects.dataloaders):
        state[f"dataloader_{i}"] = _SamplerPosition(dataloader)
    for i, obj in enumerate(objects.custom_objects):
        state[f"custom_{i}"] = obj
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler
    state["accelerator"] = _Counter(accelerator)
    state["rng"] = RNGState()
    return state


def save_state(
    accelerator: Any,
    writer: CheckpointWriter,
    step: int,
    *,
    metrics: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> SaveHandle:
    """Snapshot the accelerator's state as ``step`` with ``writer``.

    Returns once copied (written, uploaded and retained in the background: see
    ``CheckpointWriter.save``).

    Args:
        accelerator: The ``Accelerator`` whose state is saved.
        writer: The writer to save with.
        step: The training step.
        metrics: JSON values kept in the manifest.
        metadata: JSON values kept in the manifest (the batches done, for ``rest_of_epoch``).

    Returns:
        The save's handle.

    Raises:
        CheckpointError: As ``CheckpointWriter.save`` raises.
    """
    return writer.save(step, accelerator_state(accelerator), metrics=metrics, metadata=metadata)


def load_state(
    accelerator: Any,
    source: CheckpointWriter | str,
    step: int | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> RestoreInfo:
    """Restore the newest committed checkpoint (or ``step``) into the accelerator, all or nothing.

    Args:
        accelerator: The ``Accelerator`` to restore into.
        source: A writer, or a root (a local path or URL).
        step: The step to restore; None: the newest committed one.
        storage_options: fsspec options for a root ``source``.

    Returns:
        The restored checkpoint's info; it carries the saved ``metadata`` (e.g. the
        batches to skip).

    Raises:
        RestoreMismatchError: The checkpoint's objects, shapes, samplers or devices do
            not fit this accelerator.
        CheckpointNotFoundError: Nothing is committed.
    """
    targets = accelerator_state(accelerator)
    if isinstance(source, CheckpointWriter):
        return source.restore(targets, step)
    return restore(source, targets, step, storage_options=storage_options)


def rest_of_epoch(accelerator: Any, dataloader: Any, batches_done: int) -> Iterator[Any]:
    """The batches of ``dataloader``'s current epoch after the first ``batches_done``.

    In the order an uninterrupted run sees them, with torch's global generator where that run
    had it (exact when loading a batch draws no global randomness: ``num_workers=0``, or
    workers that do not use their seed); afterwards the dataloader is at the next
    epoch (``accelerator.skip_first_batches`` alone starts its epoch count again at 0).
    ``batches_done`` of ``len(dataloader)`` or more yields nothing: a save on an epoch's
    last batch restores the loader at the next epoch already. A ``save_state`` while
    these batches are handed out records the dataloader's position as its own would.

    Args:
        accelerator: The ``Accelerator`` that prepared ``dataloader``.
        dataloader: A prepared dataloader.
        batches_done: Batches of the current epoch already trained.

    Yields:
        The epoch's remaining batches.
    """
    if batches_done >= len(dataloader):
        return
    epoch = int(getattr(dataloader, "iteration", 0))
    skipped = accelerator.skip_first_batches(dataloader, batches_done)
    if hasattr(skipped, "set_epoch"):
        skipped.set_epoch(epoch)
    # Starting an epoch draws a seed from torch's global generator, which the
    # interrupted run drew before it saved: put the restored state back after it.
    rng = torch.get_rng_state()
    _iterating[dataloader] = skipped
    try:
        batches = iter(skipped)
        first = next(batches, _END)
        torch.set_rng_state(rng)
        if first is not _END:
            yield first
            yield from batches
    finally:
        _iterating.pop(dataloader, None)
    if hasattr(dataloader, "set_epoch"):
        dataloader.set_epoch(epoch + 1)
