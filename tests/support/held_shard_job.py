"""One rank of an FSDP2 job restoring from a held copy of the memory tier, run as a subprocess.

    python -m tests.support.held_shard_job ACTION ROOT OUT RANK WORLD PORT

ROOT holds step 1 of tests/support/inplace_job.py's ``save``. Each rank builds the held
copy by hand, as the service holds one (every file of the step in one writable anonymous
mapping, served by ``daemon.memstore.MemoryStore``), and ``checkpointd.restore(...,
service=...)`` is handed that copy where it would have asked the service for it
(``recall.held_copy``), so restore's own fallback to storage runs. The targets are
inplace_job's (model and optimizer built from another seed and trained one step, Picky).
ACTION ``intact``: the held copy as it is. ``flip``: the first time any byte range
covering the middle byte of this rank's own shard of the first model weight is read out
of the mapping (``read_into``) or handed out of it (``views``), that byte is flipped in
the mapping right after: what was read before it is good, anything read again later is
not (another process writing into the segment between a check and a landing).
Rank 0 writes OUT/{ACTION}.pt, the gathered state after the restore; every rank writes
OUT/rankR.json: ``ok``, ``error``, ``message``, ``source`` (``RestoreInfo.source``),
``landed`` (direct DTensors read into their local shards), ``flips`` (bytes flipped).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

import checkpointd
from checkpointd import tunables
from checkpointd.daemon.client import recall
from checkpointd.daemon.client.memstore import MemoryStore, ReadOnlyStore
from checkpointd.daemon.wire.protocol import HeldFile
from checkpointd.format.checksum import crc32c
from checkpointd.format.layout import MANIFEST_NAME, step_dirname
from checkpointd.read import boxes, catalog
from checkpointd.state.shards import local_box
from checkpointd.storage import open_store
from tests.support.inplace_job import Picky
from tests.support.shard_job import build, full_state, train


class _Flipping:
    """A held file (``storage.MappedFile``) that flips byte ``at`` of its mapping (at
    ``base`` + ``at``) once, right after the first read or view that covers it."""

    def __init__(self, inner: Any, mapped: mmap.mmap, base: int, at: int, flips: list[int]):
        self._inner, self._mapped, self._base, self._at = inner, mapped, base, at
        self._flips = flips

    def _touched(self, offset: int, length: int) -> None:
        if not self._flips and offset <= self._at < offset + length:
            self._mapped[self._base + self._at] ^= 0xFF
            self._flips.append(self._at)

    def read_into(self, buffer: memoryview, offset: int = 0) -> None:
        self._inner.read_into(buffer, offset)
        self._touched(offset, len(buffer))

    def views(self, offset: int, length: int) -> list[memoryview]:
        found: list[memoryview] = self._inner.views(offset, length)
        self._touched(offset, length)
        return found

    def unchanged(self) -> bool:
        return bool(self._inner.unchanged())

    def close(self) -> None:
        self._inner.close()


class _FlippingStore(ReadOnlyStore):
    """``held`` with one file's ``open_pinned`` wrapped in ``_Flipping``."""

    def __init__(self, held: MemoryStore, path: str, wrap: Any) -> None:
        self.url, self._held, self._path, self._wrap = held.url, held, path, wrap

    def size(self, path: str) -> int:
        return self._held.size(path)

    def read_into(self, path: str, buffer: memoryview, offset: int = 0) -> None:
        self._held.read_into(path, buffer, offset)

    def open_pinned(self, path: str) -> Any:
        pinned = self._held.open_pinned(path)
        return self._wrap(pinned) if path == self._path else pinned

    def list_dir(self, path: str) -> list[str]:
        return self._held.list_dir(path)


def _held(root: str, model: torch.nn.Module, flip: bool, flips: list[int]) -> Any:
    """Every file of step 1 in one writable mapping, as the service holds a copy; with
    ``flip``, this rank's shard file of the first model weight wrapped in ``_Flipping``."""
    folder = os.path.join(root, step_dirname(1))
    names = sorted(n for n in os.listdir(folder) if n != MANIFEST_NAME)
    sizes = [os.path.getsize(os.path.join(folder, n)) for n in names]
    mapped = mmap.mmap(-1, sum(sizes))
    starts: dict[str, int] = {}
    entries: list[HeldFile] = []
    at = 0
    for name, size in zip(names, sizes, strict=True):
        with open(os.path.join(folder, name), "rb") as f:
            data = f.read()
        mapped[at : at + size] = data
        starts[name] = at
        entries.append(HeldFile(name, b"", at, size, crc32c(data)))
        at += size
    with open(os.path.join(folder, MANIFEST_NAME), "rb") as f:
        manifest = f.read()
    store = MemoryStore.over(root, step_dirname(1), manifest, entries, mapped)
    if not flip:
        return store
    name, param = next(iter(model.named_parameters()))
    sharded = catalog.read_manifest(open_store(root), 1).components["model"].sharded[name]
    offsets, shape = local_box(param)
    (shard,) = [s for s in sharded.shards if (tuple(s.offsets), tuple(s.shape)) == (offsets, shape)]
    middle = shard.begin + param.to_local().nbytes // 2  # type: ignore[attr-defined]
    base = starts[shard.file]

    def wrap(inner: Any) -> _Flipping:
        return _Flipping(inner, mapped, base, middle, flips)

    return _FlippingStore(store, f"{step_dirname(1)}/{shard.file}", wrap)


def main() -> None:
    action, root, out, rank_s, world_s, port = sys.argv[1:]
    rank, world = int(rank_s), int(world_s)
    tunables.SHARD_BLOCK_BYTES = 256
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    result: dict[str, Any] = {"ok": False, "error": None, "message": "", "landed": 0}
    original = boxes.Boxes.land

    def counted(self: boxes.Boxes, *args: Any) -> None:
        result["landed"] += len(self.boxes)
        original(self, *args)

    boxes.Boxes.land = counted  # type: ignore[method-assign, assignment]
    model, optimizer = build("fsdp2", world, seed=1)
    train(model, optimizer, 1)
    flips: list[int] = []
    store = _held(root, model, action == "flip", flips)

    @contextlib.contextmanager
    def held_copy(*args: Any, **kwargs: Any) -> Iterator[recall.Recalled]:
        yield recall.Recalled(store, 1, lambda: "memory")

    recall.held_copy = held_copy
    targets = {"model": model, "optimizer": optimizer, "picky": Picky(2)}
    try:
        info = checkpointd.restore(root, targets, service="held by hand")
        result["ok"], result["source"] = True, info.source
    except checkpointd.CheckpointError as exc:
        result["error"], result["message"] = type(exc).__name__, str(exc)
    result["flips"] = len(flips)
    state = full_state(model, optimizer)
    if rank == 0:
        torch.save(state, os.path.join(out, f"{action}.pt"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
