"""Lightning's checkpoint dict as checkpointd components, and back.

The state half of checkpointd.integrations.lightning: ``model`` (Lightning's
``state_dict``), ``optimizers`` (``optimizer_states``), ``trainer`` (every other key:
loops, callbacks, epoch, hyperparameters...) and ``rng`` (the process's generators,
which Lightning does not save). Imports no Lightning; training thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from checkpointd.errors import InvalidArgumentError
from checkpointd.state.rng import RNGState

__all__ = ["checkpoint_of", "components_of", "step_of"]

_MODEL, _OPTIMIZERS = "model", "optimizers"
_REST = "trainer"
_RNG = "rng"


def components_of(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The components a save of Lightning's ``checkpoint`` holds (``rng`` taken now)."""
    state: dict[str, Any] = {_REST: {}}
    for key, value in checkpoint.items():
        if key == "state_dict":
            state[_MODEL] = value
        elif key == "optimizer_states":
            state[_OPTIMIZERS] = {"optimizer_states": value}
        else:
            state[_REST][key] = value
    state[_RNG] = RNGState()
    return state


def checkpoint_of(state: Mapping[str, Any], *, restore_rng: bool) -> dict[str, Any]:
    """Lightning's checkpoint dict from loaded components; with ``restore_rng`` the
    process's generators are set to the saved ones (RestoreMismatchError if the
    devices differ)."""
    checkpoint: dict[str, Any] = dict(state[_REST])
    if _MODEL in state:
        checkpoint["state_dict"] = state[_MODEL]
    if _OPTIMIZERS in state:
        checkpoint["optimizer_states"] = state[_OPTIMIZERS]["optimizer_states"]
    if restore_rng and _RNG in state:
        RNGState().load_state_dict(state[_RNG])
    return checkpoint


def step_of(checkpoint: Mapping[str, Any]) -> int:
    """Lightning's ``global_step`` (0 if absent); InvalidArgumentError if not an int >= 0."""
    step = checkpoint.get("global_step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidArgumentError(f"checkpoint['global_step'] must be an int >= 0, not {step!r}")
    return step
