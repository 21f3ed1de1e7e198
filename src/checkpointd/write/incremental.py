"""Incremental saves: write each distinct large tensor once, reference it afterwards.

``IncrementalSaver`` belongs to one writer (of one process, or of one rank of a
group that saves together) and runs on its event loop, one save at a time. Per
save: pin the blobs of the writer's previous committed checkpoint
(maintain/blobs.write_pin); hash each large tensor of the snapshot in a worker
thread (format/digest.py); choose to reference the blob of a tensor whose hash
names one of those blobs and to write every other to ``blobs/NAME``; plan the
save with those choices (plan.plan_snapshot) and make it durable like any save
(the writer's commit, which writes the new blobs and checks that every blob it
lists is still stored before the publish); then drop the pin. Tensors under
``tunables.INCREMENTAL_MIN_BYTES`` (as it was at ``save()``, in the trainer: the
snapshot's ``layout``) stay in the step's tensor file. docs/format.md ("Shared tensor
data") is the spec.

A tensor that the last save found unchanged (a frozen base weight) is hashed on
the caller's thread at the next capture instead of copied (``prehash``): hashing
runs at about 6x the speed of the copy, so ``save()`` returns sooner, and if the
bytes still match, nothing of it is copied, hashed again or written. Any other
tensor is copied as in a full save and hashed in the background, so a state that
changes on every save does not block longer.

With ``max_pending`` above 1 a capture may rely on the unchanged set of a save
older than the one being written (the tensor reset to an earlier value). Each
such reliance is counted from ``prehash`` until the relying save's own pin names
the blob; after every commit, before its retention runs, a bridge pin names the
relied-on blobs the new manifest does not list, so no deletion of this writer
(or gc) removes them in between.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import secrets
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import anyio
import msgspec
import torch

from checkpointd.errors import CheckpointError, StorageError
from checkpointd.format.digest import blob_name
from checkpointd.format.dtypes import decode_dtype, encode_dtype
from checkpointd.format.header import TensorEntry
from checkpointd.format.manifest import BlobEntry, BlobRef, CheckpointInfo, Manifest
from checkpointd.maintain.blobs import blob_stored, newest_blobs, remove_pin, write_pin
from checkpointd.read.catalog import read_manifest
from checkpointd.storage import Store
from checkpointd.write.capture import CapturedComponent
from checkpointd.write.commit import in_thread, open_step
from checkpointd.write.plan import Blobs, SavePlan, Snapshot, plan_snapshot

__all__ = ["CaptureHold", "IncrementalSaver", "SaveStats"]

_log = logging.getLogger(__name__)


@dataclass(slots=True)
class SaveStats:
    """What the last incremental save did: blobs written and referenced, and their bytes."""

    written: int = 0
    written_bytes: int = 0
    referenced: int = 0
    referenced_bytes: int = 0
    repaired: int = 0
    """Referenced blobs found missing before the publish, written again from the snapshot."""
    prehashed: int = 0
    """Tensors found unchanged at capture (hashed on the caller's thread, never copied)."""


Durable = Callable[[SavePlan], Awaitable[tuple[CheckpointInfo, Manifest | None]]]
"""Makes a plan durable (the writer's commit); returns the CheckpointInfo and the manifest
published, if this process holds it (else the saver reads it back)."""


class CaptureHold:
    """The blobs one capture relied on (``prehash`` matches); ``release`` them if the
    capture fails. Caller's thread."""

    def __init__(self, saver: IncrementalSaver) -> None:
        self._saver = saver
        self.blobs: list[str] = []

    def prehash(self, component: str, name: str, tensor: torch.Tensor) -> str | None:
        """``IncrementalSaver.prehash``, remembering a match."""
        blob = self._saver.prehash(component, name, tensor)
        if blob is not None:
            self.blobs.append(blob)
        return blob

    def release(self) -> None:
        """The capture failed: it relies on nothing."""
        self._saver.release(self.blobs)
        self.blobs = []


class IncrementalSaver:
    """Saves snapshots of one writer incrementally; call ``commit`` from its event loop,
    one save at a time.

    ``previous`` holds the blobs of the writer's previous committed checkpoint (read
    from the newest one in the root on the first save); ``stats`` describe the last save.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.previous: dict[str, BlobEntry] | None = None
        self.stats = SaveStats()
        self.unchanged: Mapping[tuple[str, str], BlobRef] = {}
        """(component, tensor) -> blob, for the tensors the last save referenced (they had
        not changed): ``prehash`` candidates. Replaced whole by the loop under ``_lock``,
        read by the caller."""
        self._lock = threading.Lock()
        self._relied: Counter[str] = Counter()
        """Blobs ``prehash`` matched for captures whose save has not pinned them yet."""
        self._bridge: str | None = None
        """The pin keeping relied-on blobs between two saves' pins (see the module)."""

    def hold(self) -> CaptureHold:
        """A capture's view of ``prehash`` that can be released if the capture fails."""
        return CaptureHold(self)

    def prehash(self, component: str, name: str, tensor: torch.Tensor) -> str | None:
        """During capture, on the caller's thread: the blob of ``tensor`` if it is one the
        last save found unchanged and its bytes still hash to that blob (then capture does
        not copy it, and the blob counts as relied on until its save pins it); None
        otherwise (capture copies it). Host tensors only."""
        ref = self.unchanged.get((component, name))
        if (
            ref is None
            or tensor.device.type != "cpu"
            or not tensor.is_contiguous()
            or tensor.is_conj()
            or tensor.is_neg()
            or decode_dtype(ref.dtype) != tensor.dtype
            or list(tensor.shape) != ref.shape
        ):
            return None
        data = tensor.detach().reshape(-1).view(torch.uint8).numpy().data
        if blob_name(data) != ref.blob:
            return None
        with self._lock:
            if self.unchanged.get((component, name)) != ref:
                return None  # a commit moved on meanwhile: its bridge may not name ref's blob
            self._relied[ref.blob] += 1
        return ref.blob

    def release(self, blobs: Iterable[str]) -> None:
        """Stop counting ``blobs`` as relied on (their save pinned them, or failed). Any thread."""
        with self._lock:
            self._relied.subtract(blobs)
            self._relied = +self._relied

    def close(self) -> None:
        """Drop the bridge pin, if any (the writer has stopped). Blocking."""
        if self._bridge is not None:
            remove_pin(self.store, self._bridge)
            self._bridge = None

    async def commit(
        self,
        snapshot: Snapshot,
        limiter: anyio.CapacityLimiter,
        durable: Durable,
        *,
        token: str | None = None,
        world_size: int = 1,
    ) -> CheckpointInfo:
        """Save ``snapshot`` referencing unchanged tensors: pin, hash, plan
        (plan.plan_snapshot with the blobs chosen), make the plan durable with ``durable``
        (the writer's commit: alone, or this rank's part of a group's) and return its
        CheckpointInfo. A rank of a group reads the published manifest back (one read), for
        the blobs every rank's next save may reference. ``token`` names the attempt
        (random if None); ``world_size`` ranks save it together. Raises as the commit.
        Event loop."""
        store = self.store
        relied = [blob for c in snapshot.components for blob in c.blobs.values()]
        alone = world_size == 1
        token = secrets.token_hex(4) if token is None else token
        try:
            if self.previous is None:
                self.previous = await in_thread(limiter, newest_blobs, store)
            if alone:  # with many ranks the collective commit checks it, on every rank
                await open_step(store, snapshot.step, limiter)
            pinned = set(self.previous) | set(relied)
            name = token if alone else f"{token}r{snapshot.rank}"
            pin = await in_thread(limiter, write_pin, store, snapshot.step, name, pinned)
        except BaseException:
            self._reset()
            raise
        finally:
            self.release(relied)  # this save's pin (if any) names them now
        try:
            plan, chosen, prehashed = await self._plan(snapshot, limiter, token, world_size)
            info, manifest = await durable(plan)
        except BaseException:
            self._reset()  # the next save copies everything: it trusts nothing of this one
            with anyio.CancelScope(shield=True):
                await in_thread(limiter, remove_pin, store, pin)
            raise
        if manifest is None:
            with contextlib.suppress(CheckpointError):  # committed: the save stands anyway
                manifest = await in_thread(limiter, read_manifest, store, snapshot.step)
        if manifest is None:  # the next save reads the newest manifest and copies all
            self._reset()
            self.previous = None
            with anyio.CancelScope(shield=True):
                await in_thread(limiter, remove_pin, store, pin)
            return info
        listed = {entry.name: entry for entry in manifest.blobs}
        self.previous = {
            name: msgspec.structs.replace(entry, written=False) for name, entry in listed.items()
        }
        with self._lock:
            self.unchanged = {
                (component, tensor): ref
                for component, refs in chosen.refs.items()
                for tensor, ref in refs.items()
                if ref.blob in listed and not listed[ref.blob].written
            }
            bridged = {name for name in self._relied if name not in listed}
        with anyio.CancelScope(shield=True):
            try:
                await in_thread(limiter, self._rebridge, snapshot.step, bridged)
            finally:
                await in_thread(limiter, remove_pin, store, pin)
        self.stats = _stats(manifest, chosen, prehashed)
        return info

    async def _plan(
        self, snapshot: Snapshot, limiter: anyio.CapacityLimiter, token: str, world_size: int
    ) -> tuple[SavePlan, Blobs, int]:
        """Hash the large tensors and this rank's shards, choose their blobs and plan the
        save with them; returns the plan, the choice and how many tensors capture found
        unchanged. Event loop."""
        chosen = Blobs()
        prehashed = await self._prehashed(snapshot, chosen, limiter)
        async with anyio.create_task_group() as group:
            for component in snapshot.components:
                for item in _large(snapshot, component):
                    group.start_soon(self._choose, chosen, component.name, item, limiter)
        chosen.own = _own(snapshot, chosen)
        plan = await in_thread(
            limiter,
            functools.partial(plan_snapshot, snapshot, token, world_size=world_size, blobs=chosen),
        )
        return plan, chosen, prehashed

    def _reset(self) -> None:
        with self._lock:
            self.unchanged = {}

    def _rebridge(self, step: int, blobs: set[str]) -> None:
        """Replace the bridge pin by one naming ``blobs`` (none if empty): the blobs captures
        still rely on that the manifest just published does not list. Before retention.
        Worker thread."""
        old, self._bridge = self._bridge, None
        if blobs:
            try:
                self._bridge = write_pin(self.store, step, secrets.token_hex(4), blobs)
            except StorageError as exc:  # the save is committed: the dependants check again
                _log.warning("could not pin blobs queued saves rely on: %s", exc)
                self._bridge, old = old, None
        if old is not None:
            remove_pin(self.store, old)

    async def _prehashed(
        self, snapshot: Snapshot, chosen: Blobs, limiter: anyio.CapacityLimiter
    ) -> int:
        """Reference the tensors capture found unchanged (``component.blobs``): their bytes
        were never copied, so their blobs must be stored already (listed by a committed
        checkpoint and pinned since, and still on storage); raises CheckpointError if one
        is not. Returns how many. Event loop."""
        assert self.previous is not None
        count = 0
        for component in snapshot.components:
            for entry in component.entries:
                name = component.blobs.get(entry.name)
                if name is None:
                    continue
                # listed by the previous checkpoint, or by an older one and kept by a pin
                known = self.previous.get(name) or BlobEntry(name, _size(entry))
                if not await in_thread(limiter, blob_stored, self.store, known):
                    raise CheckpointError(
                        f"the save of step {snapshot.step} failed: blob {name} of unchanged "
                        f"tensor {component.name}/{entry.name} is no longer stored (deleted by "
                        "another process?); nothing was published, and the next save copies "
                        "and writes every tensor"
                    )
                ref = BlobRef(name, encode_dtype(entry.dtype, "code"), list(entry.shape))
                chosen.refs.setdefault(component.name, {})[entry.name] = ref
                chosen.kept.setdefault(name, (msgspec.structs.replace(known, written=False), None))
                count += 1
        return count

    async def _choose(
        self,
        chosen: Blobs,
        component: str,
        item: tuple[TensorEntry, memoryview, bool],
        limiter: anyio.CapacityLimiter,
    ) -> None:
        """Hash one large tensor or this rank's shard of one (``item`` as ``_large`` yields
        it); keep its blob if the previous checkpoint stored those bytes, else plan to
        write it. Event loop."""
        assert self.previous is not None
        entry, view, whole = item
        name = await in_thread(limiter, blob_name, view)
        if whole:
            ref = BlobRef(name, encode_dtype(entry.dtype, "code"), list(entry.shape))
            chosen.refs.setdefault(component, {})[entry.name] = ref
        else:
            chosen.shards.setdefault(component, {})[entry.name] = name
        if name in chosen.new:
            return  # the same bytes twice in this save: written once
        if name in chosen.kept:
            kept, copy = chosen.kept[name]
            if copy is None:  # a copy to write it back from, should it vanish
                chosen.kept[name] = (kept, view)
            return
        known = self.previous.get(name)
        if known is not None and known.size == len(view):
            chosen.kept[name] = (msgspec.structs.replace(known, written=False), view)
        else:
            chosen.new[name] = view


def _own(snapshot: Snapshot, chosen: Blobs) -> set[str]:
    """The blobs only this rank holds: of its shards and its per-rank components, unless
    a replicated tensor has the same bytes (then every rank plans that blob alike)."""
    mine = {name for shards in chosen.shards.values() for name in shards.values()}
    replicated: set[str] = set()
    for component, refs in chosen.refs.items():
        names = {ref.blob for ref in refs.values()}
        if component in snapshot.per_rank:
            mine |= names
        else:
            replicated |= names
    return mine - replicated


def _stats(manifest: Manifest, chosen: Blobs, prehashed: int) -> SaveStats:
    """What the save that published ``manifest`` after choosing ``chosen`` did."""
    stats = SaveStats(prehashed=prehashed)
    for entry in manifest.blobs:
        if entry.written:
            stats.written += 1
            stats.written_bytes += entry.size
            stats.repaired += entry.name in chosen.kept
        else:
            stats.referenced += 1
            stats.referenced_bytes += entry.size
    return stats


def _size(entry: TensorEntry) -> int:
    return entry.end - entry.begin


def _large(
    snapshot: Snapshot, component: CapturedComponent
) -> Iterator[tuple[TensorEntry, memoryview, bool]]:
    """The tensors of ``component`` stored as blobs (at least the snapshot's
    ``layout.incremental_min`` bytes: the saving trainer's INCREMENTAL_MIN_BYTES) that
    capture copied, then this rank's shards of its DTensors of that size: (entry, its
    bytes in the snapshot, whether it is a whole tensor)."""
    least = max(1, snapshot.layout.incremental_min)
    for entry in component.entries:
        if _size(entry) >= least and entry.name not in component.blobs:
            yield entry, snapshot.buffer.view(component.offset + entry.begin, _size(entry)), True
    for entry in component.shard_entries:
        if _size(entry) >= least:
            at = component.shard_offset + entry.begin
            yield entry, snapshot.buffer.view(at, _size(entry)), False
