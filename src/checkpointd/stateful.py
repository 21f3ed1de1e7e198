"""The Stateful protocol: how a live object becomes a component's state tree and back.

A component value is either an object with ``state_dict()`` and
``load_state_dict()`` (modules, optimizers, schedulers, GradScaler, RNGState,
user objects), a random generator that has no ``state_dict`` of its own
(``torch.Generator``, ``numpy.random.Generator``, ``numpy.random.RandomState``,
``random.Random``), or a plain value (a tensor, an array, or a nested
dict/list/tuple of those and of primitives). Wrapped modules
(DistributedDataParallel, DataParallel, torch.compile) are unwrapped first, so
a checkpoint taken from a wrapped model loads into a plain one and back.

Before ``restore`` changes anything it calls ``check_state`` on every target;
an object may take part by defining ``check_state_dict(state)``, which raises
(preferably RestoreMismatchError) if ``load_state_dict(state)`` would refuse
the state. Everything here runs on the caller's thread.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, MutableMapping
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from checkpointd.errors import RestoreMismatchError

__all__ = [
    "Stateful",
    "check_restorable",
    "check_state",
    "component_state",
    "is_stateful",
    "layout_problems",
    "load_component",
    "unwrap",
]

_GENERATOR_KEY = "generator_state"
_BIT_GENERATOR_KEY = "bit_generator_state"
_RANDOM_STATE_KEY = "random_state"
_PYTHON_RANDOM_KEY = "python_random"


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


def _is_random_generator(value: Any) -> bool:
    return isinstance(
        value, torch.Generator | np.random.Generator | np.random.RandomState | random.Random
    )


def is_stateful(value: Any) -> bool:
    """True if ``value`` is restored in place (``load_state_dict`` or a random generator)."""
    return _is_random_generator(value) or (
        callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    )


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
        return {_BIT_GENERATOR_KEY: value.bit_generator.state}
    if isinstance(value, np.random.RandomState):
        return {_RANDOM_STATE_KEY: value.get_state(legacy=False)}
    if isinstance(value, random.Random):
        return {_PYTHON_RANDOM_KEY: python_random_state(value.getstate())}
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


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, np.ndarray):
        return "array"
    if isinstance(value, bool | np.bool_):
        return "bool"
    if isinstance(value, int | np.integer):
        return "int"
    if isinstance(value, float | np.floating):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, Mapping):
        return "dict"
    if isinstance(value, list | tuple):
        return "list"
    return type(value).__qualname__


def layout_problems(live: Any, stored: Any, path: str = "") -> list[str]:
    """How ``stored`` differs in structure from ``live``: keys, lengths, kinds, shapes, dtypes.

    Values are not compared. ``None`` matches anything (Python's cached gauss is
    ``None`` or a float). Returns an empty list when the layouts agree.
    """
    where = path or "<root>"
    if live is None or stored is None:
        return []
    live_kind, stored_kind = _kind(live), _kind(stored)
    if live_kind != stored_kind:
        return [f"{where}: stored {stored_kind}, expected {live_kind}"]
    if live_kind in ("tensor", "array"):
        if tuple(live.shape) != tuple(stored.shape) or live.dtype != stored.dtype:
            return [
                f"{where}: stored {list(stored.shape)} {stored.dtype}, "
                f"expected {list(live.shape)} {live.dtype}"
            ]
        return []
    if live_kind == "dict":
        problems: list[str] = []
        if missing := sorted(map(str, live.keys() - stored.keys())):
            problems.append(f"{where}: missing keys {missing}")
        if unexpected := sorted(map(str, stored.keys() - live.keys())):
            problems.append(f"{where}: unexpected keys {unexpected}")
        for key in live.keys() & stored.keys():
            problems += layout_problems(live[key], stored[key], f"{path}/{key}")
        return problems
    if live_kind == "list":
        if len(live) != len(stored):
            return [f"{where}: stored {len(stored)} items, expected {len(live)}"]
        problems = []
        for i, (a, b) in enumerate(zip(live, stored, strict=True)):
            problems += layout_problems(a, b, f"{path}/{i}")
        return problems
    return []


def _generator_problems(target: Any, tree: Any) -> list[str]:
    """Layout problems of a random generator's stored state (empty if it fits)."""
    live = component_state(target, "check")
    if (
        isinstance(target, torch.Generator)
        and isinstance(tree, Mapping)
        and str(tree.get("device")) != live["device"]
    ):
        return [f"generator saved on {tree.get('device')!r}, target is on {live['device']!r}"]
    if isinstance(target, np.random.Generator | np.random.RandomState) and isinstance(
        tree, Mapping
    ):
        inner = tree.get(_BIT_GENERATOR_KEY, tree.get(_RANDOM_STATE_KEY))
        live_inner = next(iter(live.values()))
        if isinstance(inner, Mapping) and inner.get("bit_generator") != live_inner["bit_generator"]:
            return [
                f"bit generator {inner.get('bit_generator')!r} saved, "
                f"target uses {live_inner['bit_generator']!r}"
            ]
    return layout_problems(live, tree)


def check_state(target: Any, tree: Any, name: str) -> None:
    """Raise RestoreMismatchError if ``load_component(target, tree)`` would not fit.

    Covers random generators, tensors, and objects defining ``check_state_dict``;
    changes nothing. Modules and optimizers are checked by ``restore`` itself.
    """
    target = unwrap(target)
    problems: list[str] = []
    if _is_random_generator(target):
        problems = _generator_problems(target, tree)
    elif isinstance(target, torch.Tensor):
        problems = layout_problems(target, tree)
    elif callable(check := getattr(target, "check_state_dict", None)):
        try:
            check(tree)
        except RestoreMismatchError as exc:
            raise RestoreMismatchError(f"component {name!r}: {exc}") from exc
        except Exception as exc:
            raise RestoreMismatchError(
                f"component {name!r} is refused by its target: {exc}"
            ) from exc
    if problems:
        raise RestoreMismatchError(
            f"component {name!r} does not fit its target: {'; '.join(problems[:8])}"
        )


def load_component(target: Any, tree: Any) -> None:
    """Load a component's state tree into a live target, in place (see ``component_state``).

    Objects get ``load_state_dict``; generators their state; a tensor is copied
    into (same shape and dtype only); a dict is cleared and updated.
    """
    target = unwrap(target)
    if isinstance(target, torch.Generator):
        # A fresh tensor: set_state on a view into a larger buffer (how loaded tensors come
        # back) crashes the process in torch 2.13.
        target.set_state(torch.as_tensor(tree[_GENERATOR_KEY], dtype=torch.uint8).clone())
    elif isinstance(target, np.random.Generator):
        target.bit_generator.state = _as_numpy(tree[_BIT_GENERATOR_KEY])
    elif isinstance(target, np.random.RandomState):
        target.set_state(_as_numpy(tree[_RANDOM_STATE_KEY]))
    elif isinstance(target, random.Random):
        target.setstate(python_random_tuple(tree[_PYTHON_RANDOM_KEY]))
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
    if isinstance(tree, Mapping):
        return {k: _as_numpy(v) for k, v in tree.items()}
    if isinstance(tree, np.ndarray):
        return np.array(tree, copy=True)
    if isinstance(tree, torch.Tensor):
        return tree.numpy().copy()
    return tree
