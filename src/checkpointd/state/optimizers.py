"""Optimizers of sharded or many-rank models: state keyed by parameter name.

An optimizer's own ``state_dict`` keys its state by parameter index, and under
FSDP2 it holds DTensors whose state a fresh optimizer does not have yet. In a
many-rank save, or when its parameters are DTensors, an optimizer is stored
through ``torch.distributed.checkpoint.state_dict`` instead: keyed by the
parameter names of the model that holds them (found among the state's
components), so it restores across world sizes, meshes and wrappers (FSDP2,
DDP, plain). Restore goes the same way: the target optimizer's state is
initialized, its DTensors are the templates the stored shards are read into,
and ``set_optimizer_state_dict`` loads it. Caller thread.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from checkpointd.errors import RestoreMismatchError, UnsupportedValueError
from checkpointd.state.shards import is_dtensor
from checkpointd.state.stateful import unwrap

__all__ = [
    "by_parameter_name",
    "is_by_name",
    "load_by_name",
    "named_template",
    "owner",
    "templates",
]


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def owner(optimizer: torch.optim.Optimizer, values: Mapping[str, Any]) -> torch.nn.Module | None:
    """The module among ``values`` that holds every parameter of ``optimizer``, or None."""
    wanted = {id(p) for p in _params(optimizer)}
    for value in values.values():
        module = unwrap(value)
        if isinstance(module, torch.nn.Module) and wanted <= {id(p) for p in module.parameters()}:
            return module
    return None


def sharded(optimizer: torch.optim.Optimizer) -> bool:
    """True if any parameter of ``optimizer`` is a DTensor."""
    return any(is_dtensor(p) for p in _params(optimizer))


def by_parameter_name(state: Mapping[str, Any], *, ranked: bool) -> dict[str, Any]:
    """``state`` with each optimizer stored by parameter name where that applies (a
    many-rank save, or DTensor parameters). Raises UnsupportedValueError for an optimizer
    of DTensors whose model is not in ``state``. Caller thread, before capture."""
    out = dict(state)
    for name, value in state.items():
        if not isinstance(value, torch.optim.Optimizer) or not (ranked or sharded(value)):
            continue
        model = owner(value, state)
        if model is None:
            if sharded(value):
                raise UnsupportedValueError(
                    f"{name}: an optimizer of DTensor parameters is saved by parameter name; "
                    "save the model that holds its parameters in the same state"
                )
            continue
        out[name] = _named_state(model, value)
    return out


@dataclass(frozen=True, slots=True)
class _Names:
    """The names DCP gave an optimizer's parameters, and the layout they hold for."""

    model: weakref.ref[torch.nn.Module]
    params: tuple[int, ...]
    """The ids of the optimizer's parameters, in the order its state_dict numbers them."""
    named: tuple[tuple[str, int], ...]
    """The model's ``named_parameters()`` as (name, id)."""
    names: tuple[str, ...]
    """The name of each of ``params``."""


_NAMES: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Names] = weakref.WeakKeyDictionary()
"""Per optimizer, its parameters' names at its last save (a save plan's part that DCP's
get_optimizer_state_dict computes again at every call: a walk of the whole model)."""


def _named_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """DCP's ``get_optimizer_state_dict(model, optimizer)``: the optimizer's own state_dict
    with each parameter's number replaced by its name. The names are kept between saves
    while the layout holds (the same parameters in the optimizer and the same named
    parameters in the model, its state initialized, its state_dict not DCP's patched one),
    and only where they were seen to give exactly DCP's result. Caller thread."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    params = tuple(map(id, _params(optimizer)))
    named = tuple((name, id(p)) for name, p in model.named_parameters())
    cached = _NAMES.get(optimizer)
    if (
        cached is not None
        and cached.params == params
        and cached.named == named
        and cached.model() is model
        and optimizer.state
        and "state_dict" not in vars(optimizer)
    ):
        return _renamed(optimizer.state_dict(), cached.names)
    _NAMES.pop(optimizer, None)
    found: dict[str, Any] = get_optimizer_state_dict(model, optimizer)
    names = tuple(p for group in found["param_groups"] for p in group["params"])
    if len(names) == len(params) and optimizer.state and "state_dict" not in vars(optimizer):
        again = _renamed(optimizer.state_dict(), names)
        if _same_shape(again, found):
            _NAMES[optimizer] = _Names(weakref.ref(model), params, named, names)
    return found


def _renamed(state: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """An optimizer's ``state_dict()`` keyed by ``names`` (its parameters' numbers' names)."""
    groups = state["param_groups"]
    for group in groups:
        group["params"] = [names[i] for i in group["params"]]
    return {"state": {names[i]: v for i, v in state["state"].items()}, "param_groups": groups}


def _same_shape(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """True if two by-name optimizer states hold the same entries: the same names in the
    same order, the same per-parameter state objects and the same group values."""
    if list(a) != list(b) or list(a["state"]) != list(b["state"]):
        return False
    if any(x is not y for x, y in zip(a["state"].values(), b["state"].values(), strict=True)):
        return False
    groups = a["param_groups"], b["param_groups"]
    return len(groups[0]) == len(groups[1]) and all(
        list(x) == list(y) and all(x[k] is y[k] if k != "params" else x[k] == y[k] for k in x)
        for x, y in zip(*groups, strict=True)
    )


def is_by_name(tree: Any) -> bool:
    """True for an optimizer state saved by parameter name (its groups list names)."""
    if not isinstance(tree, Mapping) or not isinstance(tree.get("param_groups"), list):
        return False
    return any(
        isinstance(p, str)
        for group in tree["param_groups"]
        if isinstance(group, Mapping)
        for p in group.get("params", [])
    )


def named_template(name: str, optimizer: torch.optim.Optimizer, targets: Mapping[str, Any]) -> Any:
    """The by-name state of a live optimizer of DTensors, its state initialized (what a
    stored one is read into), or None for an optimizer of plain tensors."""
    if not sharded(optimizer):
        return None
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = owner(optimizer, targets)
    if model is None:
        raise RestoreMismatchError(
            f"{name}: an optimizer of DTensor parameters is restored by parameter name; "
            "restore the model that holds its parameters in the same call"
        )
    return get_optimizer_state_dict(model, optimizer)


def _names_by_index(template: Any) -> list[str]:
    """Parameter names in the order an optimizer's own state_dict numbers them."""
    return [p for group in template["param_groups"] for p in group["params"]]


def templates(name: str, optimizer: torch.optim.Optimizer, targets: Mapping[str, Any]) -> Any:
    """The live DTensors of an optimizer of DTensors by tensor name, under both the names
    of a state stored by parameter name and those of one stored by index (a plain single
    process's checkpoint, which the optimizer's own load_state_dict then takes). Empty for
    an optimizer of plain tensors."""
    from checkpointd.state.tree import walk

    template = named_template(name, optimizer, targets)
    if template is None:
        return {}
    found = {"/".join(path): leaf for path, leaf in walk(template) if is_dtensor(leaf)}
    for index, param in enumerate(_names_by_index(template)):
        prefix = f"state/{param}/"
        found.update(
            {
                f"state/{index}/{key.removeprefix(prefix)}": leaf
                for key, leaf in list(found.items())
                if key.startswith(prefix)
            }
        )
    return found


def load_by_name(
    name: str, optimizer: torch.optim.Optimizer, tree: Any, targets: Mapping[str, Any]
) -> None:
    """Load a by-name optimizer state into ``optimizer`` through its model in ``targets``."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    model = owner(optimizer, targets)
    if model is None:
        raise RestoreMismatchError(
            f"{name}: this optimizer state was saved by parameter name; restore the model "
            "that holds the optimizer's parameters in the same call"
        )
    set_optimizer_state_dict(model, optimizer, tree)
