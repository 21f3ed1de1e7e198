"""Fit checks: whether a stored state tree fits a live object, decided before anything changes.

``restore`` calls ``check_restorable`` on every target, then ``check_fits`` on
every (target, loaded tree) pair before it loads any of them. Modules: tensor
names, shapes, dtypes. Optimizers: group hyper-parameter keys (the optimizer
type), groups, parameters per group, state shapes and dtypes. Schedulers and
GradScaler: their keys. Random generators, tensors and objects defining
``check_state_dict(state)``: ``check_state``. ``layout_problems`` compares two
trees' structure (also used by RNGState). Pure checks; the caller's thread.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import numpy as np
import torch

from checkpointd.errors import RestoreMismatchError
from checkpointd.state.optimizers import is_by_name
from checkpointd.state.stateful import (
    BIT_GENERATOR_KEY,
    RANDOM_STATE_KEY,
    SAMPLER_CHECKED,
    component_state,
    is_random_generator,
    is_sampler,
    is_stateful,
    unwrap,
)

__all__ = ["check_fits", "check_restorable", "check_state", "layout_problems"]


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
        inner = tree.get(BIT_GENERATOR_KEY, tree.get(RANDOM_STATE_KEY))
        live_inner = next(iter(live.values()))
        if isinstance(inner, Mapping) and inner.get("bit_generator") != live_inner["bit_generator"]:
            return [
                f"bit generator {inner.get('bit_generator')!r} saved, "
                f"target uses {live_inner['bit_generator']!r}"
            ]
    return layout_problems(live, tree)


def _sampler_problems(target: Any, tree: Any) -> list[str]:
    """Layout problems of a DistributedSampler's stored state, and settings that differ."""
    live = component_state(target, "check")
    if problems := layout_problems(live, tree):
        return problems
    return [
        f"sampler saved with {key}={tree[key]!r}, this one has {live[key]!r}"
        for key in SAMPLER_CHECKED
        if tree[key] != live[key]
    ]


def check_state(target: Any, tree: Any, name: str) -> None:
    """Raise RestoreMismatchError if ``load_component(target, tree)`` would not fit.

    Covers random generators, DistributedSamplers, tensors, and objects defining
    ``check_state_dict``; changes nothing. Modules and optimizers are checked by
    ``restore`` itself.
    """
    target = unwrap(target)
    problems: list[str] = []
    if is_random_generator(target):
        problems = _generator_problems(target, tree)
    elif is_sampler(target):
        problems = _sampler_problems(target, tree)
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


def _tensor_shapes(tree: Any, prefix: str = "") -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Path -> (shape, dtype) of every tensor in a module-style flat state dict."""
    if not isinstance(tree, Mapping):
        return {}
    return {
        f"{prefix}{k}": (tuple(v.shape), v.dtype)
        for k, v in tree.items()
        if isinstance(v, torch.Tensor)
    }


def _module_problems(live: torch.nn.Module, tree: Any) -> list[str]:
    expected = _tensor_shapes(live.state_dict())
    stored = _tensor_shapes(tree)
    problems: list[str] = []
    if missing := sorted(expected.keys() - stored.keys()):
        problems.append(f"missing {missing[:5]}")
    if unexpected := sorted(stored.keys() - expected.keys()):
        problems.append(f"unexpected {unexpected[:5]}")
    for key in sorted(expected.keys() & stored.keys()):
        if expected[key] != stored[key]:
            problems.append(
                f"{key}: stored {list(stored[key][0])} {stored[key][1]}, "
                f"live {list(expected[key][0])} {expected[key][1]}"
            )
    return problems


def _param_state_problems(
    where: str, param: torch.Tensor, stored: Mapping[Any, Any], live: Mapping[Any, Any] | None
) -> list[str]:
    """Check one parameter's stored optimizer state against the live state, else the param."""
    problems: list[str] = []
    for key, value in stored.items():
        if not isinstance(value, torch.Tensor):
            continue
        shape, dtype = tuple(value.shape), value.dtype
        current = live.get(key) if live else None
        if isinstance(current, torch.Tensor):
            if (shape, dtype) != (tuple(current.shape), current.dtype):
                problems.append(
                    f"{where}/{key}: stored {list(shape)} {dtype}, "
                    f"live {list(current.shape)} {current.dtype}"
                )
            continue
        # No live state yet (a fresh optimizer): torch.optim keeps per-parameter buffers
        # shaped like the parameter, or broadcastable to it (Adafactor's row/column
        # factors), in the parameter's dtype; scalars such as "step" are free.
        if value.numel() <= 1 or value.dim() != param.dim():
            continue
        fits = all(s in (1, p) for s, p in zip(shape, param.shape, strict=True))
        if not fits or (value.is_floating_point() and dtype != param.dtype):
            problems.append(
                f"{where}/{key}: stored {list(shape)} {dtype}, "
                f"parameter is {list(param.shape)} {param.dtype}"
            )
    return problems


_FREE_GROUP_KEYS = frozenset(
    {"params", "param_names", "initial_lr"}
    | {"maximize", "foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay"}
)
"""Parameter-group keys a checkpoint may lack: not hyper-parameters (``params``,
``param_names``), added by LR schedulers (``initial_lr``), or flags torch added
over releases and fills in itself when loading an older state."""


def _group_key_problems(
    kind: str, groups: list[Any] | tuple[Any, ...], live_groups: list[dict[str, Any]]
) -> list[str]:
    """The first group whose stored hyper-parameters lack one the live optimizer uses.

    The state dict records no optimizer type, but each group names its algorithm's
    hyper-parameters (AdamW: betas, eps, amsgrad; SGD: momentum, dampening,
    nesterov). ``load_state_dict`` replaces the live groups with the stored ones,
    so a key only the live side has is gone afterwards and ``step()`` fails on it.
    Keys only the checkpoint has (a newer torch's flags, a scheduler's) are ignored.
    """
    for i, (group, live_group) in enumerate(zip(groups, live_groups, strict=True)):
        if not isinstance(group, Mapping):
            return [f"group {i}: stored {type(group).__name__}, not a parameter group"]
        stored, wanted = set(map(str, group)), set(live_group) - _FREE_GROUP_KEYS
        if missing := sorted(wanted - stored):
            others = sorted(stored - set(live_group) - _FREE_GROUP_KEYS)
            instead = f" (it has {others} instead)" if others else ""
            return [
                f"group {i}: the checkpoint lacks hyper-parameter(s) {missing} that {kind} "
                f"uses{instead}; was it saved by another optimizer type?"
            ]
    return []


def _optimizer_problems(live: torch.optim.Optimizer, tree: Any) -> list[str]:
    """Optimizer type (by group hyper-parameter keys), group count, parameters per
    group, and per-parameter state shapes and dtypes."""
    if not isinstance(tree, Mapping) or not {"state", "param_groups"} <= tree.keys():
        return ["not an optimizer state dict (needs 'state' and 'param_groups')"]
    groups, live_groups = tree["param_groups"], live.param_groups
    if not isinstance(groups, list | tuple):
        return [f"param_groups is a {type(groups).__name__}, not a list"]
    if len(groups) != len(live_groups):
        return [f"{len(groups)} parameter group(s) stored, the optimizer has {len(live_groups)}"]
    if problems := _group_key_problems(type(live).__name__, groups, live_groups):
        return problems
    params: dict[Any, torch.Tensor] = {}
    for i, (group, live_group) in enumerate(zip(groups, live_groups, strict=True)):
        ids = list(group.get("params", []))
        if len(ids) != len(live_group["params"]):
            problems.append(
                f"group {i}: {len(ids)} parameter(s) stored, the optimizer has "
                f"{len(live_group['params'])}"
            )
        else:
            params.update(zip(ids, live_group["params"], strict=True))
    if problems or isinstance(live, torch.optim.LBFGS):  # LBFGS keeps flat whole-model state
        return problems
    for pid, stored in tree["state"].items():
        if pid not in params:
            problems.append(f"state for parameter id {pid!r}, which no group lists")
        elif isinstance(stored, Mapping):
            param = params[pid]
            problems += _param_state_problems(f"state/{pid}", param, stored, live.state.get(param))
    return problems


def _by_name_problems(
    name: str, live: torch.optim.Optimizer, tree: Any, targets: Mapping[str, Any]
) -> list[str]:
    """An optimizer state saved by parameter name against the live optimizer's, read the
    same way (its state initialized): parameter names, state keys, shapes and dtypes."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from checkpointd.state.optimizers import owner

    model = owner(live, targets)
    if model is None:
        return [
            "it was saved by parameter name: restore the model that holds the optimizer's "
            "parameters in the same call"
        ]
    return layout_problems(get_optimizer_state_dict(model, live), tree)


def _scheduler_problems(live: torch.optim.lr_scheduler.LRScheduler, tree: Any) -> list[str]:
    """A different scheduler class, or a different number of parameter groups."""
    if not isinstance(tree, Mapping):
        return ["not a scheduler state dict"]
    current = live.state_dict()
    missing = sorted(map(str, current.keys() - tree.keys()))
    unexpected = sorted(map(str, tree.keys() - current.keys()))
    # Keys come and go between torch versions; both at once means another scheduler class.
    if missing and unexpected:
        return [f"missing keys {missing[:5]}, unexpected keys {unexpected[:5]}"]
    return [
        f"{key}: {len(tree[key])} stored, {len(value)} live"
        for key, value in current.items()
        if key in ("base_lrs", "_last_lr")
        and isinstance(value, list)
        and isinstance(tree.get(key), list | tuple)
        and len(tree[key]) != len(value)
    ]


def check_fits(name: str, target: Any, tree: Any, targets: Mapping[str, Any] | None = None) -> None:
    """Raise RestoreMismatchError unless ``tree`` fits the live ``target``; changes nothing.

    Modules: tensor names, shapes, dtypes. Optimizers: group hyper-parameter keys
    (the optimizer type), groups, parameters per group, state shapes and dtypes. Schedulers and GradScaler: their keys. Generators,
    tensors and objects with ``check_state_dict``: see ``check_state``.
    """
    live = unwrap(target)
    problems: list[str] = []
    if isinstance(live, torch.nn.Module):
        problems = _module_problems(live, tree)
    elif isinstance(live, torch.optim.Optimizer) and is_by_name(tree):
        problems = _by_name_problems(name, live, tree, targets or {})
    elif isinstance(live, torch.optim.Optimizer):
        problems = _optimizer_problems(live, tree)
    elif isinstance(live, torch.optim.lr_scheduler.LRScheduler):
        problems = _scheduler_problems(live, tree)
    elif isinstance(live, torch.amp.GradScaler):
        problems = layout_problems(live.state_dict(), tree)
    if problems:
        raise RestoreMismatchError(
            f"component {name!r} does not fit its target: {'; '.join(problems[:8])}"
        )
    check_state(live, tree, name)
