"""``checkpointd.build``: make live objects from a checkpoint's specs, state loaded.

Safety first: every import path a build would touch is checked against
``allow`` (and a fixed deny list) before anything is imported; the resolved
object must be the class or function the path names (no walking through
modules or aliases). Blocking; call from the training thread.
"""

from __future__ import annotations

import importlib
import inspect
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import msgspec

from checkpointd import tunables
from checkpointd.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    UnsafeSpecError,
    ValidationFailedError,
)
from checkpointd.format.manifest import CheckpointInfo, Manifest, SpecEntry
from checkpointd.read import catalog
from checkpointd.rebuild.allowlist import BUILTIN_ALLOW
from checkpointd.rebuild.spec import KINDS, check_import_path
from checkpointd.storage import open_store

__all__ = ["BUILTIN_ALLOW", "DENY", "build", "is_allowed"]

_EXACT = frozenset(BUILTIN_ALLOW)  # each admits itself only, never a path below it

DENY = (
    "builtins.",
    "os.",
    "posix.",
    "nt.",
    "subprocess.",
    "sys.",
    "importlib.",
    "runpy.",
    "shutil.",
    "pickle.",
    "marshal.",
    "ctypes.",
    "code.",
    "pty.",
    "socket.",
    "torch.hub.",
    "torch.ops.",
    "torch.library.",
    "torch.package.",
    "torch.utils.cpp_extension.",
    "torch.serialization.",
    "torch.load",
)
"""Paths refused even when ``allow`` admits them: code execution, files, processes,
native libraries. A safety net, not a sandbox: keep ``allow`` to the packages
that define your models (``mypkg.models``) plus BUILTIN_ALLOW."""

Validator = Callable[[str, Any, CheckpointInfo], object]


def _matches(path: str, prefix: str) -> bool:
    if prefix in _EXACT:
        return path == prefix
    if prefix.endswith("."):
        return path.startswith(prefix)
    return path == prefix or path.startswith(prefix + ".")


def is_allowed(path: str, allow: Sequence[str]) -> bool:
    """True if dotted ``path`` matches an ``allow`` prefix and no DENY entry.

    A BUILTIN_ALLOW entry matches itself only. Another entry ending in ``.``
    matches any path starting with it; any other entry matches itself and the
    paths below it (``mypkg`` admits ``mypkg.Net``, not ``mypkg_evil.Net``).
    A path with a private (``_``) part never matches. Pure string check:
    imports nothing.
    """
    if any(part.startswith("_") for part in path.split(".")):
        return False
    if any(_matches(path, d) for d in DENY):
        return False
    return any(isinstance(a, str) and a and _matches(path, a) for a in allow)


def _check(name: str, entry: SpecEntry, allow: Sequence[str]) -> None:
    why = check_import_path(entry.module, entry.qualname)
    if why is None and not is_allowed(f"{entry.module}.{entry.qualname}", allow):
        why = "it matches no build(allow=...) prefix" + (" (or a denied one)" if allow else "")
    if why is not None:
        raise UnsafeSpecError(
            f"component {name!r}: refusing to build {entry.module}.{entry.qualname}: {why}; "
            "nothing was imported"
        )


def _resolve(name: str, entry: SpecEntry) -> Callable[..., Any]:
    """Import the allowed module and walk its qualname to a class or function."""
    try:
        obj: Any = importlib.import_module(entry.module)
    except Exception as exc:
        raise UnsafeSpecError(f"component {name!r}: cannot import {entry.module}: {exc}") from exc
    for part in entry.qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None or isinstance(obj, types.ModuleType):
            raise UnsafeSpecError(
                f"component {name!r}: {entry.module}.{entry.qualname} is not a class or "
                "function defined there"
            )
    home = (getattr(obj, "__module__", None), getattr(obj, "__qualname__", None))
    if not (inspect.isclass(obj) or inspect.isfunction(obj)) or home != (
        entry.module,
        entry.qualname,
    ):
        raise UnsafeSpecError(
            f"component {name!r}: {entry.module}.{entry.qualname} resolves to {home[0]}."
            f"{home[1]}, not to a class or function of that name"
        )
    if f"{entry.module}.{entry.qualname}" in _EXACT and not _builds_objects(obj):
        raise UnsafeSpecError(
            f"component {name!r}: {entry.module}.{entry.qualname} is not a module, optimizer "
            "or LR scheduler class in this torch"
        )
    return obj


def _builds_objects(obj: Any) -> bool:
    """Whether ``obj`` is a class BUILTIN_ALLOW may name (in the installed torch)."""
    import torch
    from torch.optim.lr_scheduler import LRScheduler

    bases = (torch.nn.Module, torch.optim.Optimizer, LRScheduler)
    return inspect.isclass(obj) and issubclass(obj, bases)


def _select(specs: Mapping[str, SpecEntry], components: Iterable[str] | None) -> list[str]:
    """The names to build.

    The requested ones, what they are built over, and the optimizers and schedulers built over them;
    in build order.
    """
    for name, entry in specs.items():
        if entry.kind not in KINDS or (entry.of is not None and entry.of not in specs):
            raise CorruptCheckpointError(f"spec of {name!r} is inconsistent: {entry}")
        size = len(msgspec.json.encode([entry.args, entry.kwargs]))
        if size > (most := tunables.MAX_SPEC_BYTES):
            raise CorruptCheckpointError(
                f"spec of {name!r}: arguments of {size} bytes, more than {most}"
            )
    if components is None:
        wanted = set(specs)
    else:
        wanted = set()
        for name in components:
            if name not in specs:
                raise CheckpointNotFoundError(
                    f"component {name!r} has no spec (specs: {', '.join(specs) or 'none'})"
                )
            wanted.add(name)
        changed = True
        while changed:
            changed = False
            for name, entry in specs.items():
                if entry.of is None or (name in wanted) == (entry.of in wanted):
                    continue
                wanted.update((name, entry.of))  # what it is built over, or what is built over it
                changed = True
    order = {"model": 0, "object": 1, "optimizer": 2, "scheduler": 3}
    return sorted(wanted, key=lambda n: (order[specs[n].kind], list(specs).index(n)))


def build(
    root: str,
    step: int | None = None,
    *,
    components: Iterable[str] | None = None,
    allow: Sequence[str] = (),
    storage_options: Mapping[str, Any] | None = None,
    map_location: Any = None,
    validators: Sequence[Validator] = (),
) -> dict[str, Any]:
    """Build the checkpoint's components from their specs and load their state.

    Models first (moved to ``map_location``), then optimizers over their model's
    parameters in the saved order, then schedulers on their optimizer; then
    every state is loaded, all or nothing (``checkpointd.restore``), and each
    validator runs. Only import paths matching ``allow`` prefixes are imported
    (private ``_`` parts never), checked before any import. Blocking.

    Args:
        root: A local path or fsspec URL.
        step: The step to build; None: the newest committed one.
        components: The names to build; each brings along what it is built over and
            what is built over it. None: every component with a spec.
        allow: Import path prefixes that may be imported (none by default;
            ``BUILTIN_ALLOW`` names torch's public module, optimizer and scheduler classes).
        storage_options: fsspec options for ``root``.
        map_location: Where models are moved before their optimizers are built.
        validators: Callables ``(name, obj, info)`` run on each built object.

    Returns:
        Component name -> the built object, its state loaded.

    Raises:
        UnsafeSpecError: A spec names a callable outside ``allow``, or one that cannot
            be imported safely.
        ValidationFailedError: A validator raised; nothing is returned.
        CheckpointNotFoundError: Nothing (or not that step) is committed.
        RestoreMismatchError: A built object does not take its stored state.
    """
    if isinstance(allow, str):
        raise InvalidArgumentError("allow must be a sequence of prefixes, not one string")
    store = open_store(str(root), storage_options)
    try:
        found, manifest = catalog.resolve(store, step)
        info = CheckpointInfo.from_manifest(manifest, catalog.step_path(store, found))
    finally:
        store.close()
    if not manifest.specs:
        raise CheckpointNotFoundError(f"step {found} was saved without specs: nothing to build")
    names = _select(manifest.specs, components)
    unstored = [name for name in names if name not in manifest.components]
    if unstored:
        raise CorruptCheckpointError(f"step {found}: specs of {unstored} have no stored state")
    for name in names:  # every check before the first import
        _check(name, manifest.specs[name], allow)
    built = _construct(manifest, names, map_location)
    from checkpointd.read.restore import restore

    restore(root, built, found, storage_options=storage_options, strict=False)
    for name in names:
        for validator in validators:
            try:
                validator(name, built[name], info)
            except Exception as exc:
                raise ValidationFailedError(
                    f"validator {getattr(validator, '__name__', validator)!r} refused {name!r} "
                    f"of step {found}: {exc}"
                ) from exc
    return built


def _construct(manifest: Manifest, names: list[str], map_location: Any) -> dict[str, Any]:
    """Call each spec (in build order), passing parameters or optimizers it is built over."""
    built: dict[str, Any] = {}
    for name in names:
        entry = manifest.specs[name]
        factory = _resolve(name, entry)
        args: list[Any] = list(entry.args)
        if entry.kind == "optimizer":
            args.insert(0, _param_groups(name, entry, built[entry.of or ""]))
        elif entry.kind == "scheduler":
            args.insert(0, built[entry.of or ""])
        try:
            obj = factory(*args, **entry.kwargs)
        except Exception as exc:
            raise CheckpointError(
                f"component {name!r}: {entry.module}.{entry.qualname}(...) failed: {exc}"
            ) from exc
        if entry.kind == "model" and map_location is not None:
            obj = obj.to(map_location)
        built[name] = obj
    return built


def _param_groups(name: str, entry: SpecEntry, model: Any) -> list[dict[str, Any]]:
    """The optimizer's param groups: the model's parameters by the names saved."""
    params = dict(model.named_parameters())
    groups = entry.params or [list(params)]
    missing = [p for group in groups for p in group if p not in params]
    if missing:
        raise CorruptCheckpointError(
            f"optimizer {name!r}: model {entry.of!r} has no parameters {missing[:5]}"
        )
    return [{"params": [params[p] for p in group]} for group in groups]
