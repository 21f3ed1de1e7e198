"""PyTorch DCP folders in, without running their pickle (``checkpointd import``).

``.metadata`` is read by ``DCPUnpickler``, which admits only DCP's own metadata
classes, torch sizes/dtypes/layouts and plain containers; values stored as bytes
by ``torch.load(weights_only=True)`` with NumPy's array and scalar rebuilders
admitted. ``EMPTY_MAPPINGS``: where ``export --format dcp`` records the empty
dicts DCP's flattening would drop. Blocking; any thread.
"""

from __future__ import annotations

import io
import os
import pickle
import stat
from collections.abc import Mapping
from typing import Any

from checkpointd import tunables
from checkpointd.errors import CorruptCheckpointError

__all__ = ["DCP_METADATA", "EMPTY_MAPPINGS", "DCPUnpickler", "brief", "empty_mappings", "read_dcp"]

DCP_METADATA = ".metadata"
EMPTY_MAPPINGS = "checkpointd.empty_mappings"
"""The DCP key under which an export lists its empty dicts (no component name has a dot)."""
_DCP = "torch.distributed.checkpoint"
_ADMITTED: dict[str, frozenset[str]] = {
    f"{_DCP}.metadata": frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "StorageMeta",
            "MetadataIndex",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    f"{_DCP}.filesystem": frozenset({"_StorageInfo"}),
    # Maps a layout's name to the torch.layout; reads a dict, calls nothing else.
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size", "strided", "sparse_coo", "contiguous_format", "preserve_format"}),
    "collections": frozenset({"OrderedDict"}),
    # StorageMeta.checkpoint_id: making a path object touches no file.
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "pathlib._local": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "builtins": frozenset({"set", "frozenset", "slice", "complex"}),
}


class DCPUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata``: DCP's metadata classes and plain values only.

    Anything else (``os.system``, ``builtins.eval``, any ``__reduce__`` to a
    callable not listed) raises CorruptCheckpointError at the name lookup,
    before it could be called.
    """

    def find_class(self, module: str, name: str) -> Any:
        import torch

        allowed = name in _ADMITTED.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
        if not allowed:
            raise CorruptCheckpointError(
                f"DCP metadata refers to {module}.{name}, which is not a DCP metadata class; "
                "refused without running it"
            )
        return super().find_class(module, name)


def _load_dcp_metadata(data: bytes, where: str) -> Any:
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = DCPUnpickler(io.BytesIO(data)).load()
    except CorruptCheckpointError:
        raise
    except Exception as exc:
        raise CorruptCheckpointError(f"{where}: unreadable DCP metadata ({brief(exc)})") from exc
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{where}: not DCP metadata ({type(metadata).__name__})")
    return metadata


def _numpy_globals() -> list[Any]:
    """What ``torch.load(weights_only=True)`` may call to rebuild NumPy arrays and scalars
    (``RNGState``'s keys, any array or NumPy scalar in a state): the array and scalar
    rebuilders, ``ndarray`` and the dtypes. None of them imports or runs other code;
    an object array's items still go through the restricted unpickler."""
    import numpy as np

    # The rebuilders are what pickling an array and a scalar name (numpy keeps the
    # array's private): ask the objects rather than numpy's internal module.
    reconstruct = np.empty(0).__reduce__()[0]
    scalar = np.float32(0).__reduce__()[0]
    found: list[Any] = [np.ndarray, np.dtype]
    found += [getattr(np.dtypes, n) for n in getattr(np.dtypes, "__all__", ())]
    for home in ("numpy._core.multiarray", "numpy.core.multiarray"):  # NumPy 2 and 1 names
        found += [(reconstruct, f"{home}._reconstruct")]
        found += [(scalar, f"{home}.scalar")]
    return found


def brief(exc: BaseException) -> str:
    """The first line of ``exc``'s message (torch's run to many), for a one-line error."""
    lines = str(exc).strip().splitlines()
    return (lines[0][:300] if lines else "") or type(exc).__name__


def _inside(folder: str, name: Any, what: str) -> int:
    """The size of regular file ``name`` in ``folder``; CorruptCheckpointError if the name
    leaves the folder (``..``, absolute, a separator, a symlink out) or is no regular file."""
    if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name:
        raise CorruptCheckpointError(f"DCP folder {folder}: {what} {name!r} is not a file name")
    root = os.path.realpath(folder)
    real = os.path.realpath(os.path.join(folder, name))
    if os.path.dirname(real) != root:
        raise CorruptCheckpointError(f"DCP folder {folder}: {what} {name!r} leads out of it")
    try:
        st = os.stat(real)
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"DCP folder {folder}: {what} {name!r} is missing") from exc
    except OSError as exc:
        raise CorruptCheckpointError(f"DCP folder {folder}: {what} {name!r}: {brief(exc)}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise CorruptCheckpointError(f"DCP folder {folder}: {what} {name!r} is not a regular file")
    return st.st_size


def _check_storage(folder: str, metadata: Any) -> None:
    """Every data file the metadata names is a regular file of this folder holding its slice."""
    items = getattr(metadata, "storage_data", None)
    if not isinstance(items, dict):
        raise CorruptCheckpointError(f"DCP folder {folder}: metadata without storage_data")
    sizes: dict[str, int] = {}
    for info in items.values():
        name: Any = getattr(info, "relative_path", None)
        offset: Any = getattr(info, "offset", None)
        length: Any = getattr(info, "length", None)
        if not all(type(n) is int and n >= 0 for n in (offset, length)):
            raise CorruptCheckpointError(f"DCP folder {folder}: bad offset or length in metadata")
        if name not in sizes:
            sizes[name] = _inside(folder, name, "data file")
        if offset + length > sizes[name]:
            raise CorruptCheckpointError(
                f"DCP folder {folder}: data file {name!r} has {sizes[name]} bytes, the metadata "
                f"reads up to byte {offset + length}"
            )


def read_dcp(folder: str) -> dict[str, Any]:
    """The state dict of a DCP folder, read in this one process; CorruptCheckpointError
    for anything damaged, or for a file name that leaves the folder."""
    import torch
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    where = os.path.join(folder, DCP_METADATA)
    _inside(folder, DCP_METADATA, "metadata file")
    with open(where, "rb") as f:
        metadata = _load_dcp_metadata(f.read(), where)
    _check_storage(folder, metadata)

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(_EmptyStateDictLoadPlanner):
        # DefaultLoadPlanner.load_bytes would torch.load(weights_only=False).
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                loaded = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                raise CorruptCheckpointError(
                    f"DCP folder {folder}: value {fqn!r} is not loadable with "
                    f"torch.load(weights_only=True) ({brief(exc)}); never fully unpickled"
                ) from exc
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    state: dict[str, Any] = {}
    known = torch.serialization.get_safe_globals()
    extra = [g for g in _numpy_globals() if g not in known]  # leave the caller's entries be
    try:
        with torch.serialization.safe_globals(extra):
            _load_state_dict(state, storage_reader=Reader(folder), planner=Planner(), no_dist=True)  # type: ignore[no-untyped-call]
    except CorruptCheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        failures = getattr(exc, "failures", None) or {}
        cause = next(iter(failures.values()))[0] if failures else exc
        if isinstance(cause, CorruptCheckpointError):
            raise cause from exc
        raise CorruptCheckpointError(
            f"DCP folder {folder}: unreadable ({type(cause).__name__}: {brief(cause)})"
        ) from exc
    _put_back_empty_mappings(state, state.pop(EMPTY_MAPPINGS, []), where)
    return {key: _int_state_keys(value) for key, value in state.items()}


def empty_mappings(tree: Mapping[str, Any]) -> list[list[str | int]]:
    """The paths of the empty dicts in ``tree``, named as DCP names them (keys as str,
    list items by index): DCP's flattening drops them, export lists them here."""
    found: list[list[str | int]] = []
    stack: list[tuple[list[str | int], Any]] = [([], tree)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, Mapping):
            if not value and path:
                found.append(path)
            stack.extend(([*path, str(k)], v) for k, v in value.items())
        elif isinstance(value, list):  # DCP walks lists holding dicts; tuples it stores whole
            stack.extend(([*path, i], v) for i, v in enumerate(value))
    return sorted(found, key=len)


def _put_back_empty_mappings(state: dict[str, Any], paths: Any, where: str) -> None:
    from torch.distributed.checkpoint._traverse import set_element

    def plain(path: Any) -> bool:
        return (
            isinstance(path, list)
            and 0 < len(path) <= tunables.MAX_JSON_DEPTH
            and isinstance(path[0], str)
            and all(
                isinstance(p, str) or (type(p) is int and 0 <= p < tunables.MAX_DCP_INDEX)
                for p in path
            )
        )

    if not isinstance(paths, list) or not all(plain(p) for p in paths):
        raise CorruptCheckpointError(f"{where}: {EMPTY_MAPPINGS} is not a list of paths")
    for path in paths:
        try:
            set_element(state, tuple(path), {})
        except (TypeError, KeyError, IndexError, AttributeError) as exc:
            raise CorruptCheckpointError(f"{where}: empty dict at {path} does not fit") from exc


def _int_state_keys(value: Any) -> Any:
    """DCP stores a plain ``optimizer.state_dict()``'s parameter indices as strings
    ("0"); give them back as ints so ``load_state_dict`` matches them again."""
    if not isinstance(value, dict) or not isinstance(value.get("state"), dict):
        return value
    groups = value.get("param_groups")
    indices = {p for g in groups or () if isinstance(g, dict) for p in g.get("params", ())}
    if not indices or not all(isinstance(p, int) for p in indices):
        return value
    state = {
        int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in value["state"].items()
    }
    return {**value, "state": state}
