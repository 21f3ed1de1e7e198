"""The torch internals the tests look at, each read in one place: torch has no public way
to ask for them (a state dict's per-module versions, an optimizer's step pre-hooks, a
negative view, a GPU busy-wait)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "cuda_sleep",
    "neg_view",
    "set_state_dict_metadata",
    "state_dict_metadata",
    "step_pre_hooks",
]


def state_dict_metadata(state_dict: Any) -> Any:
    """The ``_metadata`` torch's ``Module.state_dict()`` attaches (per-module versions)."""
    return state_dict._metadata  # noqa: SLF001 - torch's state-dict convention


def set_state_dict_metadata(state_dict: Any, metadata: Any) -> None:
    """Attach ``metadata`` as ``Module.state_dict()`` does."""
    state_dict._metadata = metadata  # noqa: SLF001 - torch's state-dict convention


def step_pre_hooks(optimizer: torch.optim.Optimizer) -> dict[int, Any]:
    """The optimizer's step pre-hooks (``register_step_pre_hook``), by handle id."""
    return optimizer._optimizer_step_pre_hooks  # noqa: SLF001 - no public accessor


neg_view: Callable[[torch.Tensor], torch.Tensor] = torch._neg_view  # noqa: SLF001 - no public maker
"""A negative view of a tensor (what ``conj().imag`` makes), made directly."""


def cuda_sleep(cycles: int) -> None:
    """Keep the current CUDA stream busy for about ``cycles`` GPU clock cycles."""
    torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]  # noqa: SLF001 - no public busy-wait kernel
