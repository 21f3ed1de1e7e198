"""Incremental saves: write each distinct large tensor once, reference it afterwards.

``IncrementalSaver`` belongs to one single-process writer and runs on its event
loop, one save at a time. Per save: pin the blobs of the writer's previous
committed checkpoint (shared.write_pin); hash each large tensor of the snapshot
in a worker thread (digest.py); reference the blob of a tensor whose hash names
one of those blobs, write every other to ``blobs/NAME``; check that every
blob it lists is still stored (and write it again from the snapshot if not);
then commit the step's own files and manifest as any save (commit.commit_plan)
and drop the pin. Tensors under ``tunables.INCREMENTAL_MIN_BYTES`` stay in the
step's tensor file. docs/format.md ("Shared tensor data") is the spec.

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

import logging
import secrets
import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import anyio
import anyio.to_thread
import msgspec
import torch

from checkpointd import tunables
from checkpointd.errors import CheckpointError, StorageError
from checkpointd.format.codec import encode_tree
from checkpointd.format.digest import blob_name
from checkpointd.format.dtypes import decode_dtype, encode_dtype
from checkpointd.format.header import TensorEntry, encode_safetensors_header
from checkpointd.format.layout import BLOBS_DIR, HEADER_ALIGN, tensor_file_name, tree_file_name
from checkpointd.format.manifest import BlobEntry, BlobRef, CheckpointInfo, ComponentEntry
from checkpointd.maintain.blobs import blob_stored, newest_blobs, remove_pin, write_blob, write_pin
from checkpointd.maintain.retention import WriterIdentity
from checkpointd.storage import Store
from checkpointd.write.capture import CapturedComponent
from checkpointd.write.commit import commit_plan, in_thread, open_step
from checkpointd.write.plan import PlannedFile, SavePlan, Snapshot, WriteFile, plan_shards

__all__ = ["CaptureHold", "IncrementalSaver", "SaveStats"]

_log = logging.getLogger("checkpointd")


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


@dataclass(slots=True)
class _Blobs:
    """The blobs of one save being planned: what each tensor refers to, and the entries."""

    previous: dict[str, BlobEntry]
    refs: dict[str, dict[str, BlobRef]] = field(default_factory=dict)
    used: dict[str, BlobEntry] = field(default_factory=dict)
    views: dict[str, memoryview] = field(default_factory=dict)
    claimed: set[str] = field(default_factory=set)


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

    def __init__(self, store: Store, *, chunk_bytes: int) -> None:
        self.store = store
        self.chunk_bytes = chunk_bytes  # per write, for blobs and files alike
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
        *,
        identity: WriterIdentity | None = None,
    ) -> CheckpointInfo:
        """Write ``snapshot`` referencing unchanged tensors; return its CheckpointInfo once
        durable. Raises as ``commit.commit_plan``. Event loop."""
        store = self.store
        relied = [blob for c in snapshot.components for blob in c.blobs.values()]
        try:
            if self.previous is None:
                self.previous = await in_thread(limiter, newest_blobs, store)
            token = secrets.token_hex(4)
            await open_step(store, snapshot.step, limiter)
            pinned = set(self.previous) | set(relied)
            pin = await in_thread(limiter, write_pin, store, snapshot.step, token, pinned)
        except BaseException:
            self._reset()
            raise
        finally:
            self.release(relied)  # this save's pin (if any) names them now
        try:
            blobs = _Blobs(dict(self.previous))
            await in_thread(limiter, store.make_dir, BLOBS_DIR)
            prehashed = await self._prehashed(snapshot, blobs, limiter)
            async with anyio.create_task_group() as group:
                for component in snapshot.components:
                    for entry in _large(component):
                        if entry.name in component.blobs:
                            continue
                        view = snapshot.buffer.view(component.offset + entry.begin, _size(entry))
                        group.start_soon(self._blob, blobs, component.name, entry, view, limiter)
            stats = await self._check_stored(blobs, limiter)
            stats.prehashed = prehashed
            await in_thread(limiter, store.sync_dir, BLOBS_DIR)
            plan = await in_thread(limiter, _plan, snapshot, token, blobs)
            info = await commit_plan(
                store, plan, limiter, identity=identity, chunk_bytes=self.chunk_bytes
            )
        except BaseException:
            self._reset()  # the next save copies everything: it trusts nothing of this one
            with anyio.CancelScope(shield=True):
                await in_thread(limiter, remove_pin, store, pin)
            raise
        self.previous = {
            name: msgspec.structs.replace(entry, written=False)
            for name, entry in blobs.used.items()
        }
        with self._lock:
            self.unchanged = {
                (component, tensor): ref
                for component, refs in blobs.refs.items()
                for tensor, ref in refs.items()
                if not blobs.used[ref.blob].written
            }
            bridged = {name for name in self._relied if name not in blobs.used}
        with anyio.CancelScope(shield=True):
            try:
                await in_thread(limiter, self._rebridge, snapshot.step, bridged)
            finally:
                await in_thread(limiter, remove_pin, store, pin)
        self.stats = stats
        return info

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
        self, snapshot: Snapshot, blobs: _Blobs, limiter: anyio.CapacityLimiter
    ) -> int:
        """Reference the tensors capture found unchanged (``component.blobs``): their bytes
        were never copied, so their blobs must be stored already (listed by a committed
        checkpoint and pinned since, and still on storage); raises CheckpointError if one
        is not. Event loop."""
        count = 0
        for component in snapshot.components:
            for entry in component.entries:
                name = component.blobs.get(entry.name)
                if name is None:
                    continue
                # listed by the previous checkpoint, or by an older one and kept by a pin
                known = blobs.previous.get(name) or BlobEntry(name, _size(entry))
                if not await in_thread(limiter, blob_stored, self.store, known):
                    raise CheckpointError(
                        f"the save of step {snapshot.step} failed: blob {name} of unchanged "
                        f"tensor {component.name}/{entry.name} is no longer stored (deleted by "
                        "another process?); nothing was published, and the next save copies "
                        "and writes every tensor"
                    )
                ref = BlobRef(name, encode_dtype(entry.dtype, "code"), list(entry.shape))
                blobs.refs.setdefault(component.name, {})[entry.name] = ref
                blobs.claimed.add(name)
                blobs.used[name] = msgspec.structs.replace(known, written=False)
                count += 1
        return count

    async def _blob(
        self,
        blobs: _Blobs,
        component: str,
        entry: TensorEntry,
        view: memoryview,
        limiter: anyio.CapacityLimiter,
    ) -> None:
        """Hash one large tensor, then reference its blob or write it. Event loop."""
        name = await in_thread(limiter, blob_name, view)
        ref = BlobRef(name, encode_dtype(entry.dtype, "code"), list(entry.shape))
        blobs.refs.setdefault(component, {})[entry.name] = ref
        blobs.views.setdefault(name, view)
        if name in blobs.claimed:
            return  # the same bytes twice in this save: written (or referenced) once
        blobs.claimed.add(name)
        known = blobs.previous.get(name)
        if known is not None and known.size == len(view):
            blobs.used[name] = msgspec.structs.replace(known, written=False)
            return
        blobs.used[name] = await in_thread(
            limiter, write_blob, self.store, name, view, self.chunk_bytes
        )

    async def _check_stored(self, blobs: _Blobs, limiter: anyio.CapacityLimiter) -> SaveStats:
        """Make sure every blob the manifest will list is stored, referenced ones and ones
        just written (a deletion in another process may have raced this save); write
        back any that is not, from the snapshot (same bytes, same name). Event loop."""
        stats = SaveStats()

        async def check(entry: BlobEntry) -> None:
            if await in_thread(limiter, blob_stored, self.store, entry):
                return
            view = blobs.views.get(entry.name)
            if view is None:  # only referenced by tensors capture did not copy
                raise CheckpointError(
                    f"blob {entry.name} vanished before the publish and this save holds no "
                    "copy of its bytes; nothing was published, the next save writes it"
                )
            blobs.used[entry.name] = await in_thread(
                limiter, write_blob, self.store, entry.name, view, self.chunk_bytes
            )
            stats.repaired += 1

        async with anyio.create_task_group() as group:
            for entry in list(blobs.used.values()):
                group.start_soon(check, entry)
        for entry in blobs.used.values():
            if entry.written:
                stats.written += 1
                stats.written_bytes += entry.size
            else:
                stats.referenced += 1
                stats.referenced_bytes += entry.size
        return stats


def _size(entry: TensorEntry) -> int:
    return entry.end - entry.begin


def _large(component: CapturedComponent) -> list[TensorEntry]:
    """The tensors of ``component`` stored as blobs (at least INCREMENTAL_MIN_BYTES)."""
    return [e for e in component.entries if _size(e) >= max(1, tunables.INCREMENTAL_MIN_BYTES)]


def _plan(snapshot: Snapshot, token: str, blobs: _Blobs) -> SavePlan:
    """The step's own files (trees, the small tensors of each component, and this
    process's shards of its DTensors) plus the blob entries and refs for the manifest.
    Worker thread (shard blocks are checksummed here)."""
    files: list[PlannedFile] = []
    components: dict[str, ComponentEntry] = {}
    for component in snapshot.components:
        name = component.name
        tree = tree_file_name(name, token)
        files.append(WriteFile(tree, [encode_tree(component.tree)], name))
        refs = blobs.refs.get(name, {})
        small: list[TensorEntry] = []
        parts: list[memoryview] = []
        position = 0
        for entry in component.entries:  # kept in order: decreasing element size
            if entry.name in refs:
                continue
            size = _size(entry)
            small.append(
                TensorEntry(entry.name, entry.dtype, entry.shape, position, position + size)
            )
            parts.append(snapshot.buffer.view(component.offset + entry.begin, size))
            position += size
        tensor_files: list[str] = []
        if small:
            tensors = tensor_file_name(name, token)
            tensor_files.append(tensors)
            header = encode_safetensors_header(small, align=HEADER_ALIGN)
            files.append(WriteFile(tensors, [header, *parts], name))
        components[name] = ComponentEntry(
            tree=tree,
            tensors=tensor_files,
            nbytes=component.nbytes,
            num_tensors=len(component.entries),
            sharded=plan_shards(component, snapshot, token, files),
            refs=refs,
        )
    return SavePlan.of(
        snapshot, files, components, sorted(blobs.used.values(), key=lambda b: b.name)
    )
