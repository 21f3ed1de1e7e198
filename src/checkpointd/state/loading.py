"""Loading a stored state tree into a live component, in place: the way back from
``stateful.component_state``.

``restore`` (read/apply.py) first asks ``dtensor_templates`` which live DTensors a
component's stored shards are read into, checks the fit (fit.py), then calls
``load_component`` on each target. Kept apart from stateful.py because loading needs
the fit checks and the by-name optimizer path, which themselves classify objects
through stateful.py. Caller's thread.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, MutableMapping
from typing import Any

import numpy as np
import torch

from checkpointd.errors import RestoreMismatchError
from checkpointd.state.fit import check_restorable, check_state, layout_problems
from checkpointd.state.optimizers import is_by_name, load_by_name, templates
from checkpointd.state.shards import is_dtensor
from checkpointd.state.stateful import (
    BIT_GENERATOR_KEY,
    GENERATOR_KEY,
    PYTHON_RANDOM_KEY,
    RANDOM_STATE_KEY,
    SAMPLER_LOADED,
    has_state_dict,
    is_sampler,
    is_stateful,
    python_random_tuple,
    unwrap,
)
from checkpointd.state.tree import map_tree, walk

__all__ = ["dtensor_templates", "load_component"]


def dtensor_templates(name: str, target: Any, targets: Mapping[str, Any]) -> dict[str, Any]:
    """The live DTensors of a target by tensor name (the names capture gives them): what
    restore reads only this rank's part of. Empty unless torch.distributed is initialized."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return {}
    live = unwrap(target)
    if is_dtensor(live):
        return {"tensor": live}
    if isinstance(live, torch.optim.Optimizer):
        found: dict[str, Any] = templates(name, live, targets)
        return found
    if has_state_dict(live):
        tree = live.state_dict()
    elif isinstance(live, Mapping | list | tuple):
        tree = live  # a plain container target: its own DTensors are the templates
    else:
        return {}
    return {"/".join(path): leaf for path, leaf in walk(tree) if is_dtensor(leaf)}


def load_component(
    name: str, target: Any, tree: Any, targets: Mapping[str, Any] | None = None
) -> None:
    """Load component ``name``'s state tree into a live target, in place.

    Objects get ``load_state_dict``; generators their state; a tensor is copied
    into (same shape and dtype only); a dict is cleared and updated; an optimizer
    state saved by parameter name goes through its model among ``targets``.
    RestoreMismatchError, naming ``name``, for a tree that does not fit or a target
    that cannot be loaded in place.
    """
    target = unwrap(target)
    if isinstance(target, torch.optim.Optimizer) and is_by_name(tree):
        load_by_name(name, target, tree, targets or {})
    elif isinstance(target, torch.Generator):
        # A fresh tensor: set_state on a view into a larger buffer (how loaded tensors come
        # back) crashes the process in torch 2.13.
        target.set_state(torch.as_tensor(tree[GENERATOR_KEY], dtype=torch.uint8).clone())
    elif isinstance(target, np.random.Generator):
        target.bit_generator.state = _as_numpy(tree[BIT_GENERATOR_KEY])
    elif isinstance(target, np.random.RandomState):
        target.set_state(_as_numpy(tree[RANDOM_STATE_KEY]))
    elif isinstance(target, random.Random):
        target.setstate(python_random_tuple(tree[PYTHON_RANDOM_KEY]))
    elif is_sampler(target):
        check_state(target, tree, name)
        target.epoch, target.seed = (int(tree[key]) for key in SAMPLER_LOADED)
    elif is_stateful(target):
        target.load_state_dict(tree)
    elif isinstance(target, torch.Tensor):
        if problems := layout_problems(target, tree):
            raise RestoreMismatchError(
                f"component {name!r}: stored tensor does not fit the target: {problems[0]}"
            )
        with torch.no_grad():
            target.copy_(tree)
    elif isinstance(target, MutableMapping):
        target.clear()
        target.update(tree)
    else:
        check_restorable(target, name)


def _as_numpy(tree: Any) -> Any:
    """A copy of a loaded bit-generator state with arrays as writable, owned NumPy arrays."""
    return map_tree(
        tree,
        lambda tensor: tensor.numpy().copy(),
        lambda leaf: np.array(leaf, copy=True) if isinstance(leaf, np.ndarray) else leaf,
    )
