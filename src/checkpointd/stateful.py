"""The Stateful protocol: how a live object becomes a component's state tree and back.

A component value is either an object with ``state_dict()`` and
``load_state_dict()`` (modules, optimizers, schedulers, GradScaler, RNGState,
user objects), a ``torch.Generator``, or a plain value (a tensor, an array, or
a nested dict/list/tuple of those and of primitives). Wrapped modules
(DistributedDataParallel, torch.compile) are unwrapped first, so a checkpoint
taken from a wrapped model loads into a plain one and back.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Protocol, runtime_checkable

import torch

from checkpointd.errors import RestoreMismatchError

__all__ = ["Stateful", "component_state", "is_stateful", "unwrap"]


@runtime_checkable
class Stateful(Protocol):
    """An object whose state round-trips through ``state_dict`` / ``load_state_dict``."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


def unwrap(value: Any) -> Any:
    """Strip DDP/FSDP-style ``.module`` and torch.compile's ``_orig_mod`` wrappers."""
    while True:
        if isinstance(value, torch.nn.Module):
            inner = getattr(value, "_orig_mod", None)
            if isinstance(inner, torch.nn.Module):
                value = inner
                continue
            if isinstance(value, torch.nn.parallel.DistributedDataParallel | torch.nn.DataParallel):
                value = value.module
                continue
        return value


def is_stateful(value: Any) -> bool:
    """True if ``value`` is restored in place by ``load_state_dict`` (or is a Generator)."""
    return isinstance(value, torch.Generator) or (
        callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    )


def component_state(value: Any, name: str) -> Any:
    """The state tree of one component value; called on the caller thread during capture."""
    value = unwrap(value)
    if isinstance(value, torch.Generator):
        return {"generator_state": value.get_state(), "device": str(value.device)}
    if is_stateful(value):
        return value.state_dict()
    return value


def check_restorable(target: Any, name: str) -> None:
    """Raise RestoreMismatchError unless ``target`` can take a state in place."""
    target = unwrap(target)
    if not (is_stateful(target) or isinstance(target, torch.Tensor | MutableMapping)):
        raise RestoreMismatchError(
            f"target for component {name!r} ({type(target).__qualname__}) cannot be restored "
            "in place: pass an object with load_state_dict(), a tensor, or a dict"
        )


def load_component(target: Any, tree: Any) -> None:
    """Load a component's state tree into a live target, in place (see ``component_state``).

    Objects get ``load_state_dict``; a Generator ``set_state``; a tensor is copied
    into; a dict is cleared and updated.
    """
    target = unwrap(target)
    if isinstance(target, torch.Generator):
        target.set_state(tree["generator_state"])
    elif is_stateful(target):
        target.load_state_dict(tree)
    elif isinstance(target, torch.Tensor):
        if not isinstance(tree, torch.Tensor) or tree.shape != target.shape:
            raise RestoreMismatchError("stored value is not a tensor of the target's shape")
        with torch.no_grad():
            target.copy_(tree)
    elif isinstance(target, MutableMapping):
        target.clear()
        target.update(tree)
    else:
        check_restorable(target, "?")
