"""Specs: how to build a component again from the checkpoint alone.

``spec(callable, *args, **kwargs)`` records an import path and JSON-able
arguments; ``save(specs=...)`` stores one per component in the manifest
(``specs``, docs/format.md) together with what kind of object it is and what
it is built over (associations: an optimizer's model and parameter order, a
scheduler's optimizer). ``checkpointd.build`` (build.py) is the reader.

Everything here runs on the caller's thread at ``spec()`` or ``save()`` time.
Importing this module does not import torch; ``record`` does.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from checkpointd import tunables
from checkpointd.errors import InvalidArgumentError, SpecChangedWarning, UnsupportedValueError
from checkpointd.format.manifest import SpecEntry

__all__ = ["Spec", "check_import_path", "record", "spec", "warn_changed"]

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
KINDS = ("model", "optimizer", "scheduler", "object")


@dataclass(frozen=True, slots=True)
class Spec:
    """An importable callable (``module``, ``qualname``) and its JSON-able arguments."""

    module: str
    qualname: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @property
    def path(self) -> str:
        """The dotted import path ``build(allow=...)`` matches against."""
        return f"{self.module}.{self.qualname}"


def check_import_path(module: str, qualname: str) -> str | None:
    """Why ``module``/``qualname`` is not a plain importable name (None if it is).

    Plain: dot-separated identifiers, no empty, relative or private (``_``,
    dunder) part, no ``<locals>``, not ``__main__``, at most 256 characters.
    Pure string checks.
    """
    if len(module) + len(qualname) + 1 > (most := tunables.MAX_IMPORT_PATH_CHARS):
        return f"the import path is longer than {most} characters"
    if module == "__main__":
        return "it is defined in __main__ (the script), which another process cannot import"
    for part in (*module.split("."), *qualname.split(".")):
        if not _IDENTIFIER.match(part):
            return f"{part!r} is not a Python identifier (local, relative or path-like name)"
        if part.startswith("_"):
            return f"it goes through the private name {part!r} (build never imports those)"
    return None


def spec(target: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Spec:
    """Record ``target(*args, **kwargs)`` for ``save(specs=...)``.

    For an optimizer leave out the parameters, for a scheduler the optimizer:
    ``build`` passes them first. Any thread.

    Args:
        target: A module-level class or function, importable by its ``__module__``
            and ``__qualname__``.
        *args: Its positional arguments: JSON values (None, bool, int, finite float,
            str, lists, tuples and str-keyed dicts).
        **kwargs: Its keyword arguments, JSON values likewise.

    Returns:
        The spec, to pass as ``save(..., specs={name: spec})``.

    Raises:
        InvalidArgumentError: ``target`` is not a module-level class or function, or
            cannot be imported by its name.
        UnsupportedValueError: An argument is not a JSON value (the error names it).
    """
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None)
    if not callable(target) or not isinstance(module, str) or not isinstance(qualname, str):
        raise InvalidArgumentError(f"spec() needs a module-level class or function, not {target!r}")
    why = check_import_path(module, qualname)
    if why is not None:
        raise InvalidArgumentError(f"spec({module}.{qualname}): cannot be rebuilt: {why}")
    name = f"spec({module}.{qualname})"
    plain_args = tuple(_plain(value, f"{name} argument {i}") for i, value in enumerate(args))
    plain_kwargs = {key: _plain(value, f"{name} argument {key!r}") for key, value in kwargs.items()}
    size = len(msgspec.json.encode([plain_args, plain_kwargs]))
    if size > (most := tunables.MAX_SPEC_BYTES):
        raise UnsupportedValueError(
            f"{name}: arguments encode to {size} bytes, more than {most}; "
            "put large values in the state instead"
        )
    return Spec(module, qualname, plain_args, plain_kwargs)


def _plain(value: Any, where: str) -> Any:
    """A plain JSON copy of ``value`` (tuples become lists); raises with the failing path."""
    root: list[Any] = [None]
    stack: list[tuple[Any, str, Any, Any, int]] = [(value, where, root, 0, 1)]
    while stack:
        item, path, parent, key, depth = stack.pop()
        if depth > tunables.MAX_JSON_DEPTH:
            raise UnsupportedValueError(
                f"{path}: nested deeper than {tunables.MAX_JSON_DEPTH} levels"
            )
        if item is None or isinstance(item, bool | str):
            if isinstance(item, str) and not _utf8(item):
                raise UnsupportedValueError(f"{path}: string is not valid UTF-8")
            parent[key] = item if item is None or type(item) in (bool, str) else str(item)
        elif isinstance(item, int):
            if not -(2**63) <= item < 2**64:
                raise UnsupportedValueError(f"{path}: integer {item} does not fit 64 bits")
            parent[key] = int(item)
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise UnsupportedValueError(f"{path}: {item} is not a JSON number")
            parent[key] = float(item)
        elif isinstance(item, list | tuple):
            out: list[Any] = [None] * len(item)
            parent[key] = out
            stack.extend((v, f"{path}[{i}]", out, i, depth + 1) for i, v in enumerate(item))
        elif isinstance(item, dict):
            obj: dict[str, Any] = {}
            parent[key] = obj
            for k, v in item.items():
                if not isinstance(k, str) or not _utf8(k):
                    raise UnsupportedValueError(f"{path}: key {k!r} is not a UTF-8 string")
                obj[k] = None
                stack.append((v, f"{path}[{k!r}]", obj, k, depth + 1))
        else:
            raise UnsupportedValueError(
                f"{path}: {type(item).__name__} is not a JSON value (use None, bool, int, "
                "float, str, list, tuple or a dict with str keys)"
            )
    return root[0]


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def record(
    state: Mapping[str, Any], specs: Mapping[str, Any], associations: Mapping[str, str]
) -> dict[str, SpecEntry]:
    """The manifest's ``specs`` for one save.

    Kinds and associations checked against the live ``state``. Raises InvalidArgumentError
    explaining any ambiguous or partial match instead of guessing. Caller's thread, at save().
    """
    import torch

    from checkpointd.state.stateful import unwrap

    for name, value in specs.items():
        if not isinstance(value, Spec):
            raise InvalidArgumentError(
                f"specs[{name!r}] must be checkpointd.spec(...), not {value!r}"
            )
        if name not in state:
            raise InvalidArgumentError(f"specs names {name!r}, which is not in the saved state")
    for name, other in associations.items():
        if name not in specs:
            raise InvalidArgumentError(f"associations names {name!r}, which has no spec")
        if not isinstance(other, str) or other not in specs:
            raise InvalidArgumentError(
                f"associations[{name!r}] = {other!r} must name a component with a spec"
            )
    live = {name: unwrap(value) for name, value in state.items()}
    models = {n: v for n, v in live.items() if isinstance(v, torch.nn.Module)}
    optimizers = {n: v for n, v in live.items() if isinstance(v, torch.optim.Optimizer)}
    entries: dict[str, SpecEntry] = {}
    for name, value in specs.items():
        obj = live[name]
        kind, of, params = "object", None, None
        if isinstance(obj, torch.nn.Module):
            kind = "model"
        elif isinstance(obj, torch.optim.Optimizer):
            kind = "optimizer"
            of, params = _optimizer_model(name, obj, models, associations.get(name))
        elif isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer) and hasattr(
            obj, "load_state_dict"
        ):
            kind = "scheduler"
            of = _scheduler_optimizer(name, obj, optimizers, associations.get(name))
        elif name in associations:
            raise InvalidArgumentError(
                f"associations[{name!r}]: only optimizers and schedulers are built over another "
                "component"
            )
        if of is not None and of not in specs:
            raise InvalidArgumentError(
                f"{kind} {name!r} is built over {of!r}, which has no spec: add one to specs"
            )
        entries[name] = SpecEntry(
            module=value.module,
            qualname=value.qualname,
            kind=kind,
            args=list(value.args),
            kwargs=dict(value.kwargs),
            of=of,
            params=params,
        )
    return entries


def _optimizer_model(
    name: str, optimizer: Any, models: Mapping[str, Any], explicit: str | None
) -> tuple[str, list[list[str]]]:
    """The model whose parameters ``optimizer`` holds, and their names per group."""
    groups = [list(group["params"]) for group in optimizer.param_groups]
    wanted = {id(p) for group in groups for p in group}
    names = {
        model: {id(p): n for n, p in module.named_parameters()} for model, module in models.items()
    }
    holding = {model: len(wanted & ids.keys()) for model, ids in names.items()}
    if explicit is not None:
        if explicit not in models:
            raise InvalidArgumentError(f"associations[{name!r}] = {explicit!r} is not a model")
        chosen = explicit
    else:
        full = [model for model, count in holding.items() if count == len(wanted)]
        if len(full) > 1:
            raise InvalidArgumentError(
                f"optimizer {name!r}: models {full} each hold all its parameters; say which "
                f"with associations={{{name!r}: {full[0]!r}}}"
            )
        chosen = full[0] if full else ""
    if not chosen or holding[chosen] != len(wanted):
        partial = {m: c for m, c in holding.items() if c} or "none"
        raise InvalidArgumentError(
            f"optimizer {name!r} holds {len(wanted)} parameters; models holding them: "
            f"{partial}. build() rebuilds an optimizer over one model's parameters: "
            "save one optimizer per model, or put the models in one module"
        )
    ids = names[chosen]
    return chosen, [[ids[id(p)] for p in group] for group in groups]


def _scheduler_optimizer(
    name: str, scheduler: Any, optimizers: Mapping[str, Any], explicit: str | None
) -> str:
    found = [n for n, opt in optimizers.items() if opt is scheduler.optimizer]
    if explicit is not None and explicit not in found:
        drives = repr(found[0]) if found else "an optimizer not in the state"
        raise InvalidArgumentError(
            f"associations[{name!r}] = {explicit!r}: scheduler {name!r} drives {drives}, "
            f"not {explicit!r}"
        )
    if not found:
        raise InvalidArgumentError(
            f"scheduler {name!r} drives an optimizer that is not in the saved state"
        )
    return found[0]


def warn_changed(
    previous: Mapping[str, SpecEntry], recorded: Mapping[str, SpecEntry], step: int
) -> None:
    """Warn (SpecChangedWarning) for each component whose spec differs from ``previous``.

    A warning, not an error: the checkpoint being saved is consistent (its
    state comes from the objects the new spec describes), and refusing it
    would lose a training run's progress over a recipe change.
    """
    for name, entry in recorded.items():
        old = previous.get(name)
        if old is None:
            continue
        before = (old.module, old.qualname, old.kind, old.args, old.kwargs, old.of)
        after = (entry.module, entry.qualname, entry.kind, entry.args, entry.kwargs, entry.of)
        if before != after:
            warnings.warn(
                f"step {step}: the spec of {name!r} changed from {_show(old)} to {_show(entry)} "
                "since this writer's previous checkpoint; build() uses each checkpoint's own",
                SpecChangedWarning,
                stacklevel=4,
            )


def _show(entry: SpecEntry) -> str:
    args = [*map(repr, entry.args), *(f"{k}={v!r}" for k, v in entry.kwargs.items())]
    return f"{entry.module}.{entry.qualname}({', '.join(args)})"


def previous_specs(store: Any, newest: int | None) -> dict[str, SpecEntry]:
    """The specs stored by the newest committed checkpoint (``{}`` if none or unreadable)."""
    if newest is None:
        return {}
    from checkpointd.errors import CheckpointError
    from checkpointd.read import catalog

    try:
        return dict(catalog.read_manifest(store, newest).specs)
    except CheckpointError:
        return {}
