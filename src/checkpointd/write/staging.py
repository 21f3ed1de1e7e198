"""Overlapped staging: a save's copy into host memory runs while training goes on.

Opt-in with ``CheckpointWriter(root, staging="overlapped")``; the default,
``"blocking"``, copies everything before ``save()`` returns. In overlapped mode
the tensors of a save are split by who may change them:

- Guarded: the parameters of every optimizer found in the saved state and those
  optimizers' own state tensors (``optimizer.state``: moments, step counts).
  They change only inside ``optimizer.step()``, so they are copied in the
  background: CPU tensors by a copier thread (``Tensor.copy_`` releases the
  GIL), CUDA tensors as non-blocking copies on a dedicated stream per device
  into the pinned arena, completed by an event. A step pre-hook on each such
  optimizer waits until the copy is complete, so no step can change them mid-copy.
- Everything else (buffers such as BatchNorm running statistics, EMA weights,
  parameters no optimizer in the state owns, scaler and user tensors) can change
  in a forward pass or anywhere else, so it is copied before ``save()`` returns.

Not guarded: changing a guarded tensor other than through ``optimizer.step()``
(``load_state_dict``, an in-place edit under ``torch.no_grad()``) while a save
is staging; call ``writer.wait_staged()`` first. One save stages at a time: the
next ``save()`` waits for the previous staging. The background write starts
once staging is complete; a staging error fails the save's handle.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import anyio.to_thread
import numpy as np
import torch
from torch.utils.hooks import RemovableHandle

from checkpointd import tunables
from checkpointd.errors import StagingError
from checkpointd.memory import bytecopy
from checkpointd.write import lifecycle
from checkpointd.write.capture import Copier, Copy

__all__ = ["STAGING_MODES", "Stager", "Staging", "StagingMode", "copy_in_background", "tensor_key"]

StagingMode = Literal["blocking", "overlapped"]
STAGING_MODES: tuple[StagingMode, ...] = ("blocking", "overlapped")

# How deep in the state's containers optimizers are looked for (components may be dicts).

_Key = tuple[torch.device, int]


class Staging:
    """The background part of one save's copy. ``done()`` once every byte of it is in
    the arena (or it failed: ``error``). Thread-safe."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: StagingError | None = None
        self.started = False
        """Whether copies were issued (capture may fail before: then it never ends)."""
        self._lock = threading.Lock()
        self._handovers: list[Callable[[StagingError | None], None]] | None = []

    def done(self) -> bool:
        """True once the copy has ended, successfully or not."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the copy has ended; False if ``timeout`` ran out first. Any thread."""
        return self._done.wait(timeout)

    async def wait_async(self) -> None:
        """Wait on the event loop until the copy has ended, then raise its error if any."""
        if not self._done.is_set():
            await anyio.to_thread.run_sync(self._done.wait, abandon_on_cancel=True)
        if self.error is not None:
            raise self.error

    def hand_over(self, callback: Callable[[StagingError | None], None]) -> bool:
        """Have ``callback(error)`` run when the copy ends, before ``done()`` turns True
        (on the thread that ends it; it must not raise); False, and nothing registered,
        if the copy has already ended. Any thread."""
        with self._lock:
            if self._handovers is None:
                return False
            self._handovers.append(callback)
            return True

    def finish(self, error: BaseException | None) -> None:
        """End the copy (``error``: it failed): run the handovers, then release the
        waiters; once, by whoever ran it."""
        if error is not None:
            self.error = StagingError(f"copying the state into host memory failed: {error}")
            self.error.__cause__ = error
        with self._lock:
            handovers, self._handovers = self._handovers or [], None
        for callback in handovers:
            callback(self.error)
        self._done.set()


class Stager:
    """One writer's overlapped staging: one save's background copy at a time, and the
    step pre-hooks on the optimizers it guards.

    ``begin`` and ``close`` are called on the caller's thread; the hooks run on
    whichever thread calls ``optimizer.step()``.
    """

    def __init__(self) -> None:
        self.current: Staging | None = None
        self._hooks: weakref.WeakKeyDictionary[torch.optim.Optimizer, RemovableHandle] = (
            weakref.WeakKeyDictionary()
        )
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._generation = lifecycle.generation()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the latest save's staging has ended; False if ``timeout`` ran out.
        Returns at once in a process that inherited the writer through fork (the
        copier thread is not there)."""
        current = self.current
        if current is None or lifecycle.inherited(self._generation):
            return True
        return current.wait(timeout)

    def begin(self, state: Mapping[str, Any]) -> tuple[Staging, Copier]:
        """Wait for the previous save's staging, guard the optimizers in ``state``,
        and return this save's Staging and the copier ``capture`` calls."""
        self.wait()
        guarded = self.guard(state)
        staging = Staging()

        def copier(copies: list[Copy], uses_cuda: bool) -> None:
            self._start(staging, copies, uses_cuda, guarded)

        return staging, copier

    def close(self) -> None:
        """Remove the step pre-hooks (caller's thread, never during a step)."""
        for handle in list(self._hooks.values()):
            handle.remove()
        self._hooks.clear()

    def guard(self, state: Mapping[str, Any]) -> set[_Key]:
        """Hook every optimizer in ``state`` (once per writer); return the storages of
        their parameters and state tensors."""
        guarded: set[_Key | None] = set()
        for optimizer in _optimizers(state, 0):
            if optimizer not in self._hooks:
                hook = functools.partial(_wait_before_step, weakref.ref(self))
                self._hooks[optimizer] = optimizer.register_step_pre_hook(hook)
            for group in optimizer.param_groups:
                guarded.update(tensor_key(p) for p in group["params"])
            for per_param in optimizer.state.values():
                if isinstance(per_param, Mapping):
                    guarded.update(tensor_key(v) for v in per_param.values() if _is_tensor(v))
        return {key for key in guarded if key is not None}

    def _start(
        self, staging: Staging, copies: list[Copy], uses_cuda: bool, guarded: set[_Key]
    ) -> None:
        """Issue the guarded copies in the background, copy the rest now; returns once
        the rest is in host memory. Caller's thread (inside ``capture``)."""
        staging.started = True
        later: list[Copy] = []
        now: list[Copy] = []
        for copy in copies:
            (later if tensor_key(copy[0]) in guarded else now).append(copy)
        try:
            events = self._issue_cuda([c for c in later if c[0].device.type == "cuda"])
        except BaseException as exc:
            staging.finish(exc)
            raise
        on_cpu = [c for c in later if c[0].device.type != "cuda"]
        thread = threading.Thread(
            target=_finish_copies, args=(staging, on_cpu, events), name="checkpointd-stage"
        )
        thread.daemon = True  # the exit hook waits for the save, hence for this copy
        self.current = staging
        try:
            thread.start()
        except RuntimeError:
            _finish_copies(staging, on_cpu, events)  # no thread to spare: copy here
        try:
            _copy_and_sync(now, uses_cuda)
        except BaseException:
            staging.wait()  # the caller releases the arena: nothing may still write to it
            raise

    def _issue_cuda(self, copies: list[Copy]) -> list[torch.cuda.Event]:
        """Queue ``copies`` on one side stream per device, after everything already
        queued on the device's current stream; one event per device marks their end."""
        events: list[torch.cuda.Event] = []
        by_device: dict[torch.device, list[Copy]] = {}
        for copy in copies:
            by_device.setdefault(copy[0].device, []).append(copy)
        for device, group in by_device.items():
            stream = self._streams.get(device)
            if stream is None:
                stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
                self._streams[device] = stream
            try:
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    for source, target in group:
                        target.copy_(source, non_blocking=True)
                        # The allocator must not hand the source's memory to another
                        # tensor (a temporary freed on the main stream) before the copy ran.
                        source.record_stream(stream)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
            except BaseException:
                for issued in self._streams.values():
                    issued.synchronize()
                raise
            events.append(event)
        return events


def copy_in_background(copies: list[Copy]) -> None:
    """Copy CPU sources into the arena (copier thread; tests replace it to hold or fail).

    Plain memory goes through NumPy: one thread, the GIL released. ``Tensor.copy_``
    would start an OpenMP team of its own next to the training thread's, and the
    two teams oversubscribing the cores cost the training steps several times the
    copy itself (measured: +1.3 s over 3 steps for a 0.14 s copy on 2 cores).
    """
    for source, target in copies:
        if source.is_contiguous() and not (source.is_conj() or source.is_neg()):
            np.copyto(_bytes(target), _bytes(source))
        else:
            target.copy_(source)


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a NumPy array (no copy)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _finish_copies(staging: Staging, copies: list[Copy], events: list[torch.cuda.Event]) -> None:
    """The copier thread: CPU copies, then wait for the CUDA copies; ends ``staging``."""
    error: BaseException | None = None
    try:
        copy_in_background(copies)
    except BaseException as exc:
        error = exc
    for event in events:
        try:
            event.synchronize()
        except BaseException as exc:
            error = error or exc
    staging.finish(error)


def _copy_and_sync(copies: list[Copy], uses_cuda: bool) -> None:
    """Copy now (plain CPU tensors as bytes on the free cores, bytecopy.py); for CUDA
    sources wait on their current streams only (a device-wide synchronize would wait
    for the side stream's background copies too)."""
    plain: list[Copy] = []
    for source, target in copies:
        if bytecopy.plain(source, target):
            plain.append((source, target))
        else:
            target.copy_(source, non_blocking=uses_cuda)
    bytecopy.copy_plain(plain)
    for device in {source.device for source, _ in copies if source.device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()


def _wait_before_step(stager_ref: weakref.ref[Stager], *_: Any) -> None:
    """Step pre-hook: the optimizer's tensors may be staging; wait until they are copied.
    Runs on the thread calling ``optimizer.step()``."""
    stager = stager_ref()
    if stager is not None:
        stager.wait()


def _optimizers(value: Any, depth: int) -> Iterator[torch.optim.Optimizer]:
    """The optimizers in a state (wrappers such as accelerate's give their inner one)."""
    if isinstance(value, torch.optim.Optimizer):
        inner = getattr(value, "optimizer", None)
        yield inner if isinstance(inner, torch.optim.Optimizer) else value
    elif depth < tunables.OPTIMIZER_SEARCH_DEPTH and isinstance(value, Mapping):
        for item in value.values():
            yield from _optimizers(item, depth + 1)
    elif depth < tunables.OPTIMIZER_SEARCH_DEPTH and isinstance(value, list | tuple):
        for item in value:
            yield from _optimizers(item, depth + 1)


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def tensor_key(tensor: torch.Tensor) -> _Key | None:
    """Which memory a tensor shows: its device and its storage's address (a DTensor's:
    its local shard's). None where a tensor has no storage to tell (it is then not
    guarded, so it is copied before ``save()`` returns)."""
    local = getattr(tensor, "_local_tensor", tensor)
    try:
        return (local.device, local.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):
        return None
