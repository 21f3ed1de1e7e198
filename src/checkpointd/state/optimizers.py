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

from collections.abc import Mapping
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
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        out[name] = get_optimizer_state_dict(model, value)
    return out


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
