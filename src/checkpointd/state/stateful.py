"""The Stateful protocol: what kind of live object a component value is, and its state tree.

A component value is either an object with ``state_dict()`` and
``load_state_dict()`` (modules, optimizers, schedulers, GradScaler, RNGState,
user objects), a random generator that has no ``state_dict`` of its own
(``torch.Generator``, ``numpy.random.Generator``, ``numpy.random.RandomState``,
``random.Random``), a ``DistributedSampler`` (its order is a function of its seed
and epoch, which are stored with the settings that partition the data), or a plain value (a tensor, an array, or a nested
dict/list/tuple of those and of primitives). Wrapped modules
(DistributedDataParallel, DataParallel, torch.compile) are unwrapped first, so
a checkpoint taken from a wrapped model loads into a plain one and back.

This module only classifies and reads live objects. Whether a stored tree fits a
target is decided in fit.py before ``restore`` changes anything (an object may take
part by defining ``check_state_dict(state)``, which raises, preferably
RestoreMismatchError, if ``load_state_dict(state)`` would refuse the state); loading
a tree into a target is loading.py. Everything here runs on the caller's thread.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

__all__ = [
    "BIT_GENERATOR_KEY",
    "GENERATOR_KEY",
    "PYTHON_RANDOM_KEY",
    "RANDOM_STATE_KEY",
    "SAMPLER_CHECKED",
    "SAMPLER_LOADED",
    "Stateful",
    "component_state",
    "has_state_dict",
    "is_random_generator",
    "is_sampler",
    "is_stateful",
    "python_random_state",
    "python_random_tuple",
    "unwrap",
]

GENERATOR_KEY = "generator_state"
BIT_GENERATOR_KEY = "bit_generator_state"
RANDOM_STATE_KEY = "random_state"
PYTHON_RANDOM_KEY = "python_random"
SAMPLER_LOADED = ("epoch", "seed")
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


def has_state_dict(value: Any) -> bool:
    """True if ``value`` has callable ``state_dict`` and ``load_state_dict``."""
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def is_sampler(value: Any) -> bool:
    """True for a ``DistributedSampler`` without a state_dict of its own."""
    from torch.utils.data.distributed import DistributedSampler

    return isinstance(value, DistributedSampler) and not has_state_dict(value)


def is_stateful(value: Any) -> bool:
    """True if ``value`` is restored in place (``load_state_dict``, a random generator or a
    DistributedSampler)."""
    return is_random_generator(value) or is_sampler(value) or has_state_dict(value)


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
        return {GENERATOR_KEY: value.get_state(), "device": str(value.device)}
    if isinstance(value, np.random.Generator):
        return {BIT_GENERATOR_KEY: value.bit_generator.state}
    if isinstance(value, np.random.RandomState):
        return {RANDOM_STATE_KEY: value.get_state(legacy=False)}
    if isinstance(value, random.Random):
        return {PYTHON_RANDOM_KEY: python_random_state(value.getstate())}
    if is_sampler(value):
        return {key: getattr(value, key) for key in (*SAMPLER_LOADED, *SAMPLER_CHECKED)}
    if is_stateful(value):
        return value.state_dict()
    return value
