"""TrainingProgress: the training loop's own state, and resuming the data pipeline mid-epoch.

A shuffled ``DataLoader`` with its own ``torch.Generator`` draws from that
generator when an epoch's iterator is created (the workers' base seed, then
the sampler's permutation). Saving the generator mid-epoch therefore captures
the state *after* this epoch's draws: restoring it and iterating again would
replay the next epoch's order, not the rest of this one. ``TrainingProgress``
keeps the generator's state from the start of the current epoch, so
``epoch_batches`` can rebuild the same order and skip the batches already
consumed.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch

from checkpointd import tunables
from checkpointd.errors import RestoreMismatchError, ResumeNotExactWarning

__all__ = ["TrainingProgress"]

T = TypeVar("T")

_KEYS = ("epoch", "step", "batch_in_epoch", "samples_seen", "history", "epoch_start_generator")


class TrainingProgress:
    """Where the loop is and what it has seen, as a Stateful component.

    ``epoch``, ``step`` (batches trained in total), ``batch_in_epoch`` (batches of
    the current epoch already handed out), ``samples_seen`` and ``history``
    (metric name -> one value per ``record`` call, the newest ``history_limit``
    of them). Save it with the model:
    ``writer.save(step, {"model": model, ..., "progress": progress})``. Use it
    from the training thread only.

    ``history`` is copied at every save on the training thread, so it is bounded:
    each metric keeps its newest ``history_limit`` values (default 1000; older
    ones are dropped as new ones come). ``None`` keeps everything, and each save
    then grows with the run (100k values cost about 80 ms of blocked time per
    save). Loading a checkpoint with a longer history keeps its newest values.

    Args:
        history_limit: Values kept per metric (the newest); None: all.

    Raises:
        ValueError: ``history_limit`` is not an int >= 0 or None.
    """

    def __init__(self, *, history_limit: int | None = tunables.DEFAULT_HISTORY_LIMIT) -> None:
        if history_limit is not None and (
            isinstance(history_limit, bool)
            or not isinstance(history_limit, int)
            or history_limit < 0
        ):
            raise ValueError(f"history_limit must be an int >= 0 or None, not {history_limit!r}")
        self.history_limit = history_limit
        self.epoch = 0
        self.step = 0
        self.batch_in_epoch = 0
        self.samples_seen = 0
        self.history: dict[str, list[float]] = {}
        self._epoch_start: torch.Tensor | None = None

    def epoch_batches(
        self, loader: Iterable[T], generator: torch.Generator | None = None
    ) -> Iterator[T]:
        """Yield the batches of the current epoch that were not consumed yet.

        ``generator`` is the one the loader shuffles with (``DataLoader(...,
        generator=g)``); a shuffling loader without its own generator draws from
        torch's global one and cannot be resumed mid-epoch exactly. Each batch
        counts as consumed (``step`` and ``batch_in_epoch`` advance) when it is
        handed out, so save after training on it. When the loader is exhausted
        the epoch advances. Every epoch starts by setting the generator to the
        state saved for that epoch's start, so after a restore the loader draws
        the same order; batches consumed before the checkpoint are drawn again
        and dropped (the sampler cannot skip without loading them). The
        generator need not be a separate component. Resuming mid-epoch a
        ``DataLoader`` without its generator cannot rewind (it draws from its own or
        torch's global generator as the epoch starts): ResumeNotExactWarning says
        what to pass.

        Args:
            loader: The epoch's batches (a DataLoader, any iterable).
            generator: The generator the loader shuffles with, rewound to the epoch's start.

        Yields:
            The batches not consumed yet, in the loader's order.

        Raises:
            RestoreMismatchError: The progress is mid-epoch but was saved without a
                generator, so the order cannot be rewound.
        """
        if generator is None and self.batch_in_epoch:
            _warn_not_rewound(loader, self.epoch, self.batch_in_epoch)
        if generator is not None:
            if self._epoch_start is not None:
                generator.set_state(self._epoch_start)
            elif self.batch_in_epoch:
                raise RestoreMismatchError(
                    "progress is mid-epoch but holds no generator state for the epoch's start: "
                    "it was saved without a generator passed to epoch_batches"
                )
            else:
                self._epoch_start = generator.get_state()
        batches = iter(loader)
        for skipped in range(self.batch_in_epoch):
            if next(batches, _END) is _END:
                raise RestoreMismatchError(
                    f"the loader has only {skipped} batches, progress says {self.batch_in_epoch} "
                    "were consumed this epoch"
                )
        for batch in batches:
            self.step += 1
            self.batch_in_epoch += 1
            yield batch
        self.epoch += 1
        self.batch_in_epoch = 0
        self._epoch_start = None if generator is None else generator.get_state()

    def record(self, samples: int = 0, **metrics: float) -> None:
        """Count ``samples`` more samples seen and append each metric to ``history``.

        A metric's oldest value beyond ``history_limit`` is dropped.

        Args:
            samples: Samples seen since the last call.
            **metrics: Metric name -> its value now.
        """
        self.samples_seen += samples
        for name, value in metrics.items():
            values = self.history.setdefault(name, [])
            values.append(float(value))
            if self.history_limit is not None and len(values) > self.history_limit:
                del values[: len(values) - self.history_limit]

    def state_dict(self) -> dict[str, Any]:
        """The progress, as a component's state tree.

        Returns:
            Plain values, plus the epoch-start generator state (a uint8 tensor) if any.
        """
        return {
            "epoch": self.epoch,
            "step": self.step,
            "batch_in_epoch": self.batch_in_epoch,
            "samples_seen": self.samples_seen,
            "history": {k: list(v) for k, v in self.history.items()},
            "epoch_start_generator": self._epoch_start,
        }

    def check_state_dict(self, state_dict: Any) -> None:
        """Check ``state_dict`` has exactly this class's keys.

        Args:
            state_dict: A stored progress tree.

        Raises:
            RestoreMismatchError: It has other keys, or is not a mapping.
        """
        if not isinstance(state_dict, Mapping) or set(state_dict) != set(_KEYS):
            got = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict)
            raise RestoreMismatchError(f"progress state must have keys {list(_KEYS)}, got {got}")

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Take the saved progress (checked first; nothing changes if it is refused).

        Args:
            state_dict: A stored progress tree (``state_dict()``'s).

        Raises:
            RestoreMismatchError: As ``check_state_dict``.
        """
        self.check_state_dict(state_dict)
        start = state_dict["epoch_start_generator"]
        keep = self.history_limit
        history = {
            str(k): [float(x) for x in (v if keep is None else v[len(v) - keep :])]
            for k, v in state_dict["history"].items()
        }
        self.epoch = int(state_dict["epoch"])
        self.step = int(state_dict["step"])
        self.batch_in_epoch = int(state_dict["batch_in_epoch"])
        self.samples_seen = int(state_dict["samples_seen"])
        self.history = history
        self._epoch_start = None if start is None else torch.as_tensor(start).clone()


def _warn_not_rewound(loader: Iterable[Any], epoch: int, batch: int) -> None:
    """Warn that a DataLoader resumed mid-epoch without its generator is not bit-exact."""
    if not isinstance(loader, torch.utils.data.DataLoader):
        return  # what another iterable draws is not known here
    where = f"resuming epoch {epoch} after batch {batch} without the loader's generator: "
    if isinstance(loader.generator, torch.Generator):
        why = (
            "the loader draws from its own generator when the epoch starts and it is not "
            "rewound; pass it: epoch_batches(loader, loader.generator)"
        )
    else:
        why = (
            "the loader draws from torch's global generator when the epoch starts, so the "
            "resumed run draws once more than the interrupted one; give the loader its own "
            "generator, DataLoader(..., generator=g), and pass it: epoch_batches(loader, g)"
        )
    warnings.warn(
        where + why + " (this resume is not bit-exact)", ResumeNotExactWarning, stacklevel=3
    )


_END: Any = object()
