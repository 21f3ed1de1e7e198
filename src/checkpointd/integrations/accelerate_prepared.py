"""The one place checkpointd reads state that accelerate keeps private on an ``Accelerator``.

An ``Accelerator`` records, in order, the models, optimizers, schedulers and dataloaders
``prepare()`` returned and the objects given to ``register_for_checkpointing()``, in
five lists accelerate has no public accessor for (its own ``save_state`` reads them).
They are read here and nowhere else, so that a release which renames them breaks one
function: this adapter is tied to the accelerate release pyproject.toml pins
(``accelerate>=1.15,<1.16``), which tests/integration/test_accelerate.py runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["PINNED", "Prepared", "on_last_batch", "prepared"]

PINNED = "1.15"
"""The accelerate minor release these names are those of."""

_LISTS = ("models", "optimizers", "schedulers", "dataloaders", "custom_objects")
"""Each is the attribute ``_<name>`` of an Accelerator (accelerate 1.15)."""


@dataclass(frozen=True)
class Prepared:
    """What an Accelerator has registered, each in registration order (copies of its lists)."""

    models: tuple[Any, ...]
    optimizers: tuple[Any, ...]
    schedulers: tuple[Any, ...]
    dataloaders: tuple[Any, ...]
    custom_objects: tuple[Any, ...]


def prepared(accelerator: Any) -> Prepared:
    """The objects ``accelerator`` has prepared and registered. Raises AttributeError (as
    reading them directly did) naming the pinned release if this accelerate lacks one."""
    lists: dict[str, tuple[Any, ...]] = {}
    for name in _LISTS:
        private = f"_{name}"  # accelerate's own name: private to it, pinned above
        if not hasattr(accelerator, private):
            raise AttributeError(
                f"{type(accelerator).__name__} has no {private}: checkpointd reads the "
                f"objects an Accelerator prepared as accelerate {PINNED} keeps them"
            )
        lists[name] = tuple(getattr(accelerator, private))
    return Prepared(**lists)


def on_last_batch(dataloader: Any) -> bool:
    """True while ``dataloader`` is being iterated and has handed out the last batch of
    its epoch: accelerate looks one batch ahead and sets ``end_of_dataloader`` before
    yielding that batch, and its ``GradientState.dataloader_references`` lists the loaders
    being iterated (the epoch counter, ``iteration``, moves on only after the loop asks
    for one more batch). False for a loader accelerate did not prepare."""
    if not getattr(dataloader, "end_of_dataloader", False):
        return False
    gradient_state = getattr(dataloader, "gradient_state", None)
    references = getattr(gradient_state, "dataloader_references", ())
    return any(ref is dataloader for ref in references)
