"""The Stateful protocol: how a live object becomes a component's state tree and back.

A component value is either an object with ``state_dict()`` and
``load_state_dict()`` (modules, optimizers, schedulers, GradScaler, RNGState,
user objects), a random generator that has no ``state_dict`` of its own
(``torch.Generator``, ``numpy.random.Generator``, ``numpy.random.RandomState``,
``random.Random``), a ``DistributedSampler`` (its order is a function of its seed
and epoch, which are stored with the settings that partition the data), or a plain value (a tensor, an array, or a nested
dict/list/tuple of those and of primitives). Wrapped modules
(DistributedDataParallel, DataParallel, torch.compile) are unwrapped first, so
a checkpoint taken from a wrapped model loads into a plain one and back.

Whether a stored tree fits a target is decided in fit.py before ``restore``
changes anything; an object may take part by defining ``check_state_dict(state)``,
which raises (preferably RestoreMismatchError) if ``load_state_dict(state)``
would refuse the state. Everything here runs on the caller's thread.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, MutableMapping
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from checkpointd.errors import RestoreMismatchError
from checkpointd.state.tree import map_tree

__all__ = [
    "BIT_GENERATOR_KEY",
    "RANDOM_STATE_KEY",
    "SAMPLER_CHECKED",
    "Stateful",
    "component_state",
    "dtensor_templates",
    "is_random_generator",
    "is_sampler",
    "is_stateful",
    "load_component",
    "unwrap",
]

_GENERATOR_KEY = "generator_state"
BIT_GENERATOR_KEY = "bit_generator_state"
RANDOM_STATE_KEY = "random_state"
_PYTHON_RANDOM_KEY = "python_random"
_SAMPLER_LOADED = ("epoch", "seed")
SAMPLER_CHECKED = ("num_replicas", "rank", "shuffle", "drop_last", "num_samples")
"""A DistributedSampler's settings that decide which indices it yields: stored, and
required to match on restore (a sampler for another rank or dataset is refused)."""


@runtime_checkable
class Stateful(Protocol):
    """An object whose state round-trips through ``state_dict`` / ``load_state_dict``."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


def unwrap(value: Any) -> Any:
    """Strip DDP/DataParallel ``.module`` and torch.compile's ``_orig_mod`` wrappers."""
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


def is_random_generator(value: Any) -> bool:
    return isinstance(
        value, torch.Generator | np.random.Generator | np.random.RandomState | random.Random
    )


def _has_state_dict(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def is_sampler(value: Any) -> bool:
    """True for a ``DistributedSampler`` without a state_dict of its own."""
    from torch.utils.data.distributed import DistributedSampler

    return isinstance(value, DistributedSampler) and not _has_state_dict(value)


def is_stateful(value: Any) -> bool:
    """True if ``value`` is restored in place (``load_state_dict``, a random generator or a
    DistributedSampler)."""
    return is_random_generator(value) or is_sampler(value) or _has_state_dict(value)


def python_random_state(state: tuple[Any, ...]) -> dict[str, Any]:
    """``random.getstate()``'s tuple as a plain tree (version, 625 ints, cached gauss)."""
    version, internal, gauss = state
    return {"version": version, "state": list(internal), "gauss": gauss}


def python_random_tuple(tree: Mapping[str, Any]) -> tuple[Any, ...]:
    """The inverse of ``python_random_state``: a tuple ``random.setstate`` takes."""
    gauss = tree["gauss"]
    return (
        int(tree["version"]),
        tuple(int(x) for x in tree["state"]),
        None if gauss is None else float(gauss),
    )


def component_state(value: Any, name: str) -> Any:
    """The state tree of one component value; called on the caller thread during capture."""
    value = unwrap(value)
    if isinstance(value, torch.Generator):
        return {_GENERATOR_KEY: value.get_state(), "device": str(value.device)}
    if isinstance(value, np.random.Generator):
        return {BIT_GENERATOR_KEY: value.bit_generator.state}
    if isinstance(value, np.random.RandomState):
        return {RANDOM_STATE_KEY: value.get_state(legacy=False)}
    if isinstance(value, random.Random):
        return {_PYTHON_RANDOM_KEY: python_random_state(value.getstate())}
    if is_sampler(value):
        return {key: getattr(value, key) for key in (*_SAMPLER_LOADED, *SAMPLER_CHECKED)}
    if is_stateful(value):
        return value.state_dict()
    return value


def dtensor_templates(name: str, target: Any, targets: Mapping[str, Any]) -> dict[str, Any]:
    """The live DTensors of a target by tensor name (the names capture gives them): what
    restore reads only this rank's part of. Empty unless torch.distributed is initialized."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return {}
    from checkpointd.state.optimizers import templates
    from checkpointd.state.shards import is_dtensor
    from checkpointd.state.tree import walk

    live = unwrap(target)
    if is_dtensor(live):
        return {"tensor": live}
    if isinstance(live, torch.optim.Optimizer):
        found: dict[str, Any] = templates(name, live, targets)
        return found
    if _has_state_dict(live):
        tree = live.state_dict()
    elif isinstance(live, Mapping | list | tuple):
        tree = live  # a plain container target: its own DTensors are the templates
    else:
        return {}
    return {"/".join(path): leaf for path, leaf in walk(tree) if is_dtensor(leaf)}


def load_component(target: Any, tree: Any, targets: Mapping[str, Any] | None = None) -> None:
    """Load a component's state tree into a live target, in place (see ``component_state``).

    Objects get ``load_state_dict``; generators their state; a tensor is copied
    into (same shape and dtype only); a dict is cleared and updated; an optimizer
    state saved by parameter name goes through its model among ``targets``.
    """
    from checkpointd.state.fit import check_restorable, layout_problems  # fit imports this module
    from checkpointd.state.optimizers import is_by_name, load_by_name

    target = unwrap(target)
    if isinstance(target, torch.optim.Optimizer) and is_by_name(tree):
        load_by_name("optimizer", target, tree, targets or {})
    elif isinstance(target, torch.Generator):
        # A fresh tensor: set_state on a view into a larger buffer (how loaded tensors come
        # back) crashes the process in torch 2.13.
        target.set_state(torch.as_tensor(tree[_GENERATOR_KEY], dtype=torch.uint8).clone())
    elif isinstance(target, np.random.Generator):
        target.bit_generator.state = _as_numpy(tree[BIT_GENERATOR_KEY])
    elif isinstance(target, np.random.RandomState):
        target.set_state(_as_numpy(tree[RANDOM_STATE_KEY]))
    elif isinstance(target, random.Random):
        target.setstate(python_random_tuple(tree[_PYTHON_RANDOM_KEY]))
    elif is_sampler(target):
        from checkpointd.state.fit import check_state

        check_state(target, tree, "sampler")
        target.epoch, target.seed = (int(tree[key]) for key in _SAMPLER_LOADED)
    elif is_stateful(target):
        target.load_state_dict(tree)
    elif isinstance(target, torch.Tensor):
        if problems := layout_problems(target, tree):
            raise RestoreMismatchError(f"stored tensor does not fit the target: {problems[0]}")
        with torch.no_grad():
            target.copy_(tree)
    elif isinstance(target, MutableMapping):
        target.clear()
        target.update(tree)
    else:
        check_restorable(target, "?")


def _as_numpy(tree: Any) -> Any:
    """A copy of a loaded bit-generator state with arrays as writable, owned NumPy arrays."""
    return map_tree(
        tree,
        lambda tensor: tensor.numpy().copy(),
        lambda leaf: np.array(leaf, copy=True) if isinstance(leaf, np.ndarray) else leaf,
    )
