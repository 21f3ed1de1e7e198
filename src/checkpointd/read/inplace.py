"""Restore straight into live memory: which stored tensors land in a target's own tensors
(targets.py says which targets qualify), the plan, the backup and the landing order;
landing.py does the two passes over each file, boxes.py the same per shard block for
targets holding DTensors (each rank's boxes land in its local shards).

``restore`` (restore.py) reads a component through ``read_for_restore``. For a target
whose ``load_state_dict`` is known to either copy each tensor into its own memory
(``nn.Module``, a tensor) or adopt the given tensors as they are (``torch.optim``
optimizers, a dict), every stored tensor whose live counterpart is a contiguous CPU
tensor of the same dtype and shape is a *direct* tensor: its bytes are read into the
live tensor's memory, once, instead of into fresh memory that is then copied. A CUDA
live tensor is direct too: its bytes land through a reused pinned bounce buffer
(bounce.py) in step 3, the order and the checks being the same.

Why that stays all or nothing, with at most two ``tunables.READ_CHUNK_BYTES`` buffers
of extra memory for the direct tensors:

1. **Check pass** (nothing changes): each tensor file holding a direct tensor is
   streamed whole through two reused chunk buffers and its CRC32C compared with the
   manifest; its other tensors are copied out into fresh memory on the way. Sizes,
   headers, the tree and the fit checks are all done by then. On a store that can
   pin a file (``Store.open_pinned``: a POSIX descriptor) the file stays open, so a
   deletion or rename meanwhile (retention, ``gc``) changes nothing it reads; on
   other stores the file is read whole into memory instead (one extra copy, no pin).
2. **Load** (may fail, rolled back): ``load_state_dict`` runs on every target with the
   direct tensors being the target's *own* tensors: a module copies each onto itself
   (torch returns at once), an optimizer adopts the same tensors, so no tensor value
   changes yet; everything else (non-direct tensors, hyper-parameters, counters) is
   loaded. If any target refuses, every target gets its backup back: a backup holds
   the direct tensors by reference (they did not change) and copies only what the
   load changed (non-direct tensors a module copies into, non-tensor leaves).
3. **Landing** (cannot fail on a committed checkpoint): the direct tensors' bytes are
   read from the pinned file straight into the live tensors, once, with no second
   CRC32C: they are the bytes the check pass checked, read again from the same open
   file, which must still be unchanged (``PinnedFile.unchanged``: its size and
   modification time, which any write into it sets) once they have landed. On an
   unpinned store they are copied from the file read in step 1, which cannot fail at
   all. On a pinned file only an in-place write into a committed file by another
   program (checkpointd never writes one: files are created under temporary names and
   renamed) or a media error during the reads could make this step fail; that is
   reported as CorruptCheckpointError naming the components whose tensors may be part
   restored, after the rest is rolled back. Tensors landing on a device go through
   the bounce buffer and are checked again there (the check overlaps the copy to the
   device).

Each file lands in one of the ways strategies.py names (chosen once per file): step 1
and 3 above are ``REREAD``, ``WHOLE`` and ``BOUNCED``. The service's memory tier
(``CHECKED_COPY``) is the one exception to "check, then land": its bytes are already in memory, so a separate check pass would read all of
them once more than the copy does (a third of a memory restore's time). Its check pass
only copies the non-direct tensors out; the landing copies the direct tensors and
checks the whole file as it lands (``bytecopy.copy_checked``). A mismatch there (a held
copy damaged after it was written) fails the landing as above, and ``restore`` then
reads storage, which lands over every tensor: the targets end as storage's checkpoint,
or, if storage fails its checks too, with the mix named in the error.

Blocking; the caller's thread (it starts one helper thread per file while streaming).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from checkpointd.errors import StorageNotFoundError
from checkpointd.format.codec import decode_tree
from checkpointd.format.header import TensorEntry
from checkpointd.read.bounce import Bounce, needs_bounce
from checkpointd.read.boxes import Boxes
from checkpointd.read.landing import Landing, check_pass, land_file
from checkpointd.read.reader import StepReader
from checkpointd.read.targets import Taken, dtensor_lands_in_place, lands_in_place
from checkpointd.state.shards import is_dtensor
from checkpointd.state.stateful import component_state, unwrap
from checkpointd.state.tree import alias_key, map_tree, walk
from checkpointd.storage.base import PinnedFile

__all__ = ["Planned", "backup", "land", "lands_in_place", "read_for_restore", "release"]


@dataclass
class Planned:
    """A component read for restore: its tree (direct tensors are the live ones) and
    what is left to land: tensor files' ``landings``, DTensor ``boxes``. ``how`` is
    ``lands_in_place``'s answer, None for the plain path."""

    tree: Any
    how: str | None = None
    landings: list[Landing] = field(default_factory=list)
    boxes: Boxes | None = None

    def lands(self) -> bool:
        """Whether anything lands straight in the target's tensors after the load."""
        return bool(self.landings) or self.boxes is not None

    def direct_keys(self) -> set[tuple[Any, ...]]:
        keys = {alias_key(t) for landing in self.landings for t in landing.direct.values()}
        return keys | (self.boxes.keys() if self.boxes is not None else set())


def _key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """``alias_key`` of a tensor, of its local shard for a DTensor."""
    return alias_key(tensor.to_local() if is_dtensor(tensor) else tensor)  # type: ignore[attr-defined]


class _Probe(Mapping[str, torch.Tensor]):
    """Stands in for a component's tensors while its tree is decoded once to see where
    each tensor goes: a distinct empty tensor per request, remembered by id."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.handed: dict[int, tuple[str, torch.Tensor]] = {}
        self.requests: dict[str, int] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise KeyError(name)
        placeholder = torch.empty(0, dtype=torch.uint8)
        self.handed[id(placeholder)] = (name, placeholder)
        self.requests[name] = self.requests.get(name, 0) + 1
        return placeholder

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __iter__(self) -> Any:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _fits(live: torch.Tensor, entry: TensorEntry) -> bool:
    """Whether ``entry``'s bytes can be read straight into ``live``'s memory."""
    return (
        type(live) in (torch.Tensor, torch.nn.Parameter)
        and live.layout == torch.strided
        and (live.device.type == "cpu" or needs_bounce(live))
        and live.dtype == entry.dtype
        and tuple(live.shape) == tuple(entry.shape)
        and live.numel() > 0
        and live.is_contiguous()
        and not live.is_conj()
        and not live.is_neg()
        and live.numel() * live.element_size() == entry.end - entry.begin
    )


def _direct(
    probe: _Probe,
    probe_tree: Any,
    live_tree: Any,
    by_name: Mapping[str, TensorEntry],
    optimizer: bool,
) -> dict[str, torch.Tensor]:
    """Tensor name -> the live tensor its bytes can land in: used only as tensors, every
    use at a path whose live tensor shows the same memory, fitting it exactly. For an
    optimizer only its per-parameter ``state``: ``load_state_dict`` deep-copies the
    parameter groups, so a tensor there (a tensor ``lr``) is not kept."""
    live = {
        path: leaf
        for path, leaf in walk(live_tree)
        if isinstance(leaf, torch.Tensor) and (not optimizer or path[:1] == ("state",))
    }
    uses: dict[str, list[tuple[str, ...]]] = {}
    for path, leaf in walk(probe_tree):
        if isinstance(leaf, torch.Tensor) and id(leaf) in probe.handed:
            uses.setdefault(probe.handed[id(leaf)][0], []).append(path)
    direct: dict[str, torch.Tensor] = {}
    taken = Taken()
    for name, paths in uses.items():
        entry = by_name.get(name)
        if entry is None or len(paths) != probe.requests.get(name):
            continue
        dests = [live.get(path) for path in paths]
        first = dests[0]
        if first is None or not _fits(first, entry):
            continue
        if any(d is None or alias_key(d) != alias_key(first) for d in dests[1:]):
            continue
        if not taken.take(first, entry.end - entry.begin):
            continue  # overlaps another direct tensor's memory: copy it the usual way
        direct[name] = first
    return direct


def read_for_restore(
    reader: StepReader, name: str, target: Any, templates: Mapping[str, Any]
) -> Planned:
    """Read component ``name`` for restoring into ``target``: checked (sizes, headers,
    CRC32C of every file), nothing changed. Direct tensors (see the module docstring) are
    the target's own tensors in the returned tree, still holding their old values, and
    are left to ``land``; ``release`` the result when done (it may hold open files)."""
    entry = reader.manifest.components[name]
    tree_bytes = reader.tree(entry)
    if templates:
        return _plan_dtensors(reader, name, target, templates, tree_bytes)
    how = lands_in_place(target)
    if how is None or not entry.tensors:
        return Planned(reader.component(name, entry, templates, tree=tree_bytes))
    opened: dict[str, tuple[PinnedFile | None, torch.Tensor | None]] = {}
    try:
        layouts = {file: _open(reader, file, opened) for file in entry.tensors}
        return _plan(reader, name, target, templates, how, tree_bytes, layouts, opened)
    finally:
        for pinned, _ in opened.values():
            if pinned is not None:
                pinned.close()  # those not handed to a landing


def _plan_dtensors(
    reader: StepReader, name: str, target: Any, templates: Mapping[str, Any], tree_bytes: bytes
) -> Planned:
    """``read_for_restore`` for a target holding DTensors: its direct boxes (boxes.py)
    checked while the tree is decoded; read the usual way if the tree does not hold each
    live DTensor once at its own path."""
    entry = reader.manifest.components[name]
    how = dtensor_lands_in_place(target)
    if how is None or not entry.sharded:
        return Planned(reader.component(name, entry, templates, tree=tree_bytes))
    boxes = Boxes(reader)
    try:
        tree = reader.component(name, entry, templates, tree=tree_bytes, take=boxes.take)
        if boxes.boxes and boxes.at_own_paths(tree):
            boxes.check()
            return Planned(tree, how, boxes=boxes)
    except BaseException:
        boxes.close()
        raise
    boxes.close()
    if not boxes.boxes:
        return Planned(tree)
    return Planned(reader.component(name, entry, templates, tree=tree_bytes))


def _open(
    reader: StepReader,
    file: str,
    opened: dict[str, tuple[PinnedFile | None, torch.Tensor | None]],
) -> tuple[int, list[TensorEntry]]:
    """Pin ``file`` where the store can, else read it whole once (checked, one request
    on an object store: no separate header reads); its layout."""
    try:
        pinned = reader.store.open_pinned(f"{reader.folder}/{file}")
    except StorageNotFoundError:
        raise reader.vanished(file) from None
    if pinned is not None:
        opened[file] = (pinned, None)
        return reader.layout(file)
    whole = reader.read(file)  # size and CRC32C checked
    opened[file] = (None, whole)
    return reader.layout_of(file, whole)


def _plan(  # noqa: PLR0917 - the one caller passes what it already has
    reader: StepReader,
    name: str,
    target: Any,
    templates: Mapping[str, Any],
    how: str,
    tree_bytes: bytes,
    layouts: Mapping[str, tuple[int, list[TensorEntry]]],
    opened: dict[str, tuple[PinnedFile | None, torch.Tensor | None]],
) -> Planned:
    """``read_for_restore`` once each tensor file is pinned (or read whole) in ``opened``;
    the pins it hands to a landing are removed from ``opened``."""
    entry = reader.manifest.components[name]
    whole = {file: source for file, (_, source) in opened.items() if source is not None}
    preloaded = {file: reader.tensors_of(file, source) for file, source in whole.items()}
    owner = {e.name: file for file, (_, entries) in layouts.items() for e in entries}
    by_name = {
        e.name: e
        for _, entries in layouts.values()
        for e in entries
        if e.name not in entry.sharded and e.name not in entry.refs
    }
    probe = _Probe(set(owner) | set(entry.sharded) | set(entry.refs))
    where = f"{reader.where}/{entry.tree}"
    probe_tree = decode_tree(tree_bytes, probe, where=where)
    from checkpointd.state.optimizers import is_by_name

    direct = {}
    if not (how == "adopt" and is_by_name(probe_tree)):
        live = unwrap(target)
        optimizer = isinstance(live, torch.optim.Optimizer)
        direct = _direct(probe, probe_tree, component_state(live, name), by_name, optimizer)
    if not direct:
        tree = reader.component(name, entry, templates, tree=tree_bytes, preloaded=preloaded)
        return Planned(tree)
    landings: list[Landing] = []
    try:
        for file, (start, entries) in layouts.items():
            mine = {n: t for n, t in direct.items() if owner[n] == file}
            if mine:
                ordered = sorted(entries, key=lambda e: e.begin)
                pinned, source = opened.pop(file)
                crc = reader.files[file].crc32c
                landing = Landing(file, start, ordered, mine, crc, pinned=pinned, source=source)
                landings.append(landing)
                preloaded[file] = {**check_pass(reader, landing), **mine}
        tree = reader.component(name, entry, templates, tree=tree_bytes, preloaded=preloaded)
    except BaseException:
        release([Planned(None, how, landings)])
        raise
    return Planned(tree, how, landings)


def backup(target: Any, planned: Planned) -> Any:
    """What restores ``target`` if a load fails before landing: its state tree with the
    direct tensors (and, for "adopt" targets, every tensor: their load never writes into
    a tensor) by reference, everything else copied."""
    keep = planned.direct_keys()
    adopt = planned.how == "adopt"

    def copy_tensor(tensor: torch.Tensor) -> torch.Tensor:
        if adopt or _key(tensor) in keep:
            return tensor
        return tensor.detach().to("cpu", copy=True)

    def copy_leaf(value: Any) -> Any:
        return value.copy() if isinstance(value, np.ndarray) else copy.deepcopy(value)

    return map_tree(component_state(target, "backup"), copy_tensor, copy_leaf)


def still_held(target: Any, planned: Planned) -> bool:
    """After the load: whether ``target`` still holds every direct tensor (so landing its
    bytes restores it). A safety net: true for every kind ``lands_in_place`` accepts."""
    if not planned.lands():
        return True
    held = {
        _key(leaf)
        for _, leaf in walk(component_state(target, "check"))
        if isinstance(leaf, torch.Tensor)
    }
    return planned.direct_keys() <= held


def land(where: str, planned: Planned, staging: Bounce | None = None) -> None:
    """Read the direct tensors' bytes into the live tensors, checking each pinned file's
    CRC32C again over what landed (``where``: the step, for messages);
    CorruptCheckpointError if it differs (the file changed since the check pass).
    ``staging``: the bounce buffer device tensors land through (else one of its own)."""
    with Bounce() as own:  # allocates nothing unless used
        for landing in planned.landings:
            land_file(where, landing, staging or own)
            for live in landing.direct.values():
                # As an in-place copy would: autograd then refuses a backward through a
                # graph that saved the old values, instead of using the new ones silently.
                torch.autograd.graph.increment_version(live)
        if planned.boxes is not None:
            planned.boxes.land(where, staging or own)


def release(planned: list[Planned]) -> None:
    """Close the files ``read_for_restore`` kept open and drop the kept copies."""
    for item in planned:
        for landing in item.landings:
            if landing.pinned is not None:
                pinned, landing.pinned = landing.pinned, None
                pinned.close()
            landing.source = None
            landing.kept = []
        if item.boxes is not None:
            item.boxes.close()
