"""State trees: the one place that knows how containers nest and how tensors alias.

A state tree is made of containers (a Mapping, list or tuple) and leaves (a
tensor, a NumPy array, a primitive). A module state dict carries ``_metadata``
(per-prefix versions) on the dict object itself, not as an item: ``metadata``
finds it, ``map_tree`` keeps it. Two tensors alias when they show the same memory
the same way (``alias_key``). Pure functions; any thread.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["alias_key", "children", "flatten", "map_tree", "metadata", "walk"]

Path = tuple[str, ...]


def children(value: Any) -> list[tuple[Any, Any]] | None:
    """(key, child) pairs of a container in order (indices for lists and tuples); None
    for a leaf. ``_metadata`` is not a child: see ``metadata``."""
    if isinstance(value, Mapping):
        return list(value.items())
    if isinstance(value, list | tuple):
        return list(enumerate(value))
    return None


def metadata(value: Any) -> Mapping[Any, Any] | None:
    """The ``_metadata`` a module state dict carries as an attribute, else None."""
    found = getattr(value, "_metadata", None) if isinstance(value, Mapping) else None
    return found if isinstance(found, Mapping) else None


def alias_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Equal for two tensors exactly when they show the same memory the same way.

    A conjugate or negative view shares its base's memory but not its values, so
    the key tells it apart from its base.
    """
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tensor.dtype,
        tuple(tensor.shape),
        tensor.stride(),
        tensor.is_conj(),
        tensor.is_neg(),
    )


def walk(tree: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Every leaf of ``tree`` with its path of keys (as str), depth first in order."""
    items = children(tree)
    if items is None:
        yield path, tree
        return
    for key, child in items:
        yield from walk(child, (*path, str(key)))


def flatten(
    tree: Any, *, sep: str = ".", unique: bool = False
) -> tuple[dict[str, torch.Tensor], int]:
    """Every tensor (NumPy arrays as tensors) of ``tree`` under its ``sep``-joined path,
    and the count of other leaves left out. With ``unique``, a tensor aliasing one
    already taken is left out. Raises ValueError if two paths give the same name."""
    import numpy as np

    found: dict[str, torch.Tensor] = {}
    seen: set[tuple[Any, ...]] = set()
    skipped = 0
    for path, leaf in walk(tree):
        value = torch.from_numpy(leaf) if isinstance(leaf, np.ndarray) else leaf
        if not isinstance(value, torch.Tensor):
            skipped += 1
            continue
        if unique:
            key = alias_key(value)
            if key in seen:
                continue
            seen.add(key)
        name = sep.join(path) or "tensor"
        if name in found:
            raise ValueError(f"two tensors would both be named {name!r}")
        found[name] = value
    return found, skipped


def map_tree(
    tree: Any,
    on_tensor: Callable[[torch.Tensor], Any],
    on_leaf: Callable[[Any], Any] = lambda value: value,
) -> Any:
    """Rebuild a state tree with ``on_tensor`` applied once per distinct tensor object
    (aliased tensors stay aliased) and ``on_leaf`` to every other leaf. Containers
    keep their types where they can, and a module state dict its ``_metadata``."""
    done: dict[int, Any] = {}

    def visit(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) not in done:
                done[id(value)] = on_tensor(value)
            return done[id(value)]
        if isinstance(value, dict):
            items = [(k, visit(v)) for k, v in value.items()]
            try:
                result = type(value)(items)
            except TypeError:  # a dict subclass with another constructor (defaultdict)
                result = dict(items)
            if hasattr(value, "_metadata"):
                # torch keeps a state dict's per-module versions here, with no public accessor
                result._metadata = copy.deepcopy(value._metadata)  # type: ignore[attr-defined]  # noqa: SLF001 - torch's convention
            return result
        if isinstance(value, list):
            return [visit(v) for v in value]
        if isinstance(value, tuple):
            return tuple(visit(v) for v in value)
        return on_leaf(value)

    return visit(tree)
