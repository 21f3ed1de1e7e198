"""Watching preemption signals: a flag the training loop checks at step boundaries.

Spot instances, SLURM and Kubernetes send SIGTERM (or SIGUSR1) seconds before
they kill a job. ``PreemptionWatch`` installs a handler for the chosen signals
that only sets a flag (no I/O, no locks: safe at any point of the program) and
then calls any Python handler that was installed before it. The default
action (SIG_DFL, which would end the process) is replaced, not chained: the
loop is expected to see ``writer.preempted``, save and exit on its own.

In a job of many ranks each rank sees its own signal, perhaps at another step:
``any_rank`` makes them agree, one small all_reduce on the writer's process
group at each step boundary, and only for writers that watch. Install and
remove from the main thread (Python delivers signals there).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable
from types import FrameType
from typing import Any

from checkpointd.errors import InvalidArgumentError

__all__ = ["PreemptionWatch", "any_rank"]


class PreemptionWatch:
    """Handlers for ``signals`` that set ``triggered``; ``remove`` puts the old ones back."""

    def __init__(self, signals: Iterable[int]) -> None:
        wanted = tuple(dict.fromkeys(signal.Signals(s) for s in signals))
        if not wanted:
            raise InvalidArgumentError("watch_preemption needs at least one signal")
        if threading.current_thread() is not threading.main_thread():
            raise InvalidArgumentError(
                "watch_preemption must be called from the main thread (signal handlers)"
            )
        self.signals = wanted
        self.received: int | None = None  # the first signal seen
        self._event = threading.Event()
        self._previous: dict[int, Any] = {}
        for sig in wanted:
            self._previous[sig] = signal.signal(sig, self._handle)

    @property
    def triggered(self) -> bool:
        """Whether one of the signals arrived (any thread)."""
        return self._event.is_set()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """The handler: set the flag, then chain a Python handler installed before."""
        if self.received is None:
            self.received = signum
        self._event.set()
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)

    def remove(self) -> None:
        """Put back the handlers found at install time (main thread; a no-op elsewhere)."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def any_rank(flag: bool, group: Any = None) -> bool:
    """True if ``flag`` is True on any rank of ``group`` (None: the default process
    group): one all_reduce (MAX) of one integer, on the device the group's backend
    needs. A collective: every rank of the group calls it at the same step boundary,
    from the training thread."""
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if "nccl" in str(dist.get_backend(group)).lower():
        device = torch.device("cuda", torch.cuda.current_device())
    value = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())
