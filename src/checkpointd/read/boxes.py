"""Restore DTensors straight into their local shards: the DTensor half of inplace.py.

For a target that takes its tensors in place (``targets.dtensor_lands_in_place``: a
plain or FSDP2 module, a plain optimizer loaded by parameter name, a dict), each stored
sharded tensor whose live DTensor's local shard is a contiguous CPU (or CUDA) tensor of
the same dtype is *direct*: the decoder is handed the live DTensor itself, and the bytes of the
rank's box are read into the local shard's memory once, after every check has passed.
The order is inplace.py's, per block instead of per file (shards carry one CRC32C per
``block_bytes`` block):

1. **check pass** (``Boxes.take`` while decoding, then ``Boxes.check``; nothing changes): every block of every
   shard the box overlaps is read through two reused block buffers and checked against
   its CRC32C. The shard files stay pinned (``Store.open_pinned``), so retention or ``gc``
   deleting them meanwhile changes nothing; on a store that cannot pin, the box's part of
   each shard is read into fresh memory (checked) and kept until landing instead.
2. **load**: the target's ``load_state_dict`` gets its own DTensors (a module copies each
   onto itself, which torch skips; an optimizer keeps them), so no value changes yet;
   ``Boxes.at_own_paths`` first checks the tree uses each live DTensor once, at the path
   it was taken for (else the component is read the usual way).
3. **landing** (``Boxes.land``): where a part is contiguous both in the shard and in the
   local shard (FSDP2's row shards, on any world size) it is read straight into the
   local shard in one read, not checked again: its blocks were checked in step 1 and
   the pinned file must still be unchanged afterwards (``PinnedFile.unchanged``, as in
   inplace.py); other parts are read into fresh memory through the pin (checked) and
   copied. On a pinned file only another program writing into a committed file, or a
   media error, can fail here (CorruptCheckpointError).

Each shard file lands in one of the ways strategies.py names, chosen in step 1: the
above is ``REREAD`` (``WHOLE`` off a store that cannot pin). Blocks bound for a device
land ``BOUNCED`` (each read into the bounce buffer, checked there, copied); a memory
tier file ``CHECKED_COPY`` (each block copied into the local shard and its CRC32C
taken of the landed bytes, ``bytecopy.copy_checked_each``), so what lands is what was
checked even if the segment is written into meanwhile; a mismatch fails the landing,
and restore then reads storage over it (restore.py).

Blocking; the thread reading the component (plus one helper thread while streaming).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from checkpointd.errors import CorruptCheckpointError, StorageNotFoundError
from checkpointd.format.checksum import Span, crc32c_each
from checkpointd.format.manifest import ShardedTensor, ShardEntry
from checkpointd.memory import bytecopy
from checkpointd.read.bounce import Block, Bounce, needs_bounce, transfer_for
from checkpointd.read.landing import bytes_of, require_unchanged
from checkpointd.read.reader import StepReader
from checkpointd.read.strategies import (
    BOUNCED,
    BOUNCED_MAPPED,
    CHECKED_COPY,
    WHOLE,
    Strategy,
    choose,
)
from checkpointd.read.targets import Taken
from checkpointd.state.shards import Box, intersect, local_box, run_in
from checkpointd.state.tree import alias_key, walk
from checkpointd.storage.base import MappedFile, PinnedFile

__all__ = ["Boxes"]


@dataclass
class _Part:
    """The piece of one shard that lands in a local shard."""

    shard: ShardEntry
    part: Box
    lo: int
    hi: int
    total: int
    """The shard's size in bytes."""
    contiguous: tuple[int, int, int] | None
    """(shard byte begin, shard byte end, local byte offset) if the part is one run of
    bytes in both the shard and the local shard, else None."""
    kept: torch.Tensor | None = None
    """On a store that cannot pin: the part, read and checked in the check pass."""


@dataclass
class _Box:
    """A live DTensor whose local shard takes its stored box directly."""

    name: str
    live: torch.Tensor
    local: torch.Tensor
    box: Box
    dtype: torch.dtype
    parts: list[_Part] = field(default_factory=list)


def _fits(local: torch.Tensor, dtype: torch.dtype, box: Box) -> bool:
    return (
        type(local) is torch.Tensor
        and local.layout == torch.strided
        and (local.device.type == "cpu" or needs_bounce(local))
        and local.dtype == dtype
        and tuple(local.shape) == tuple(box[1])
        and local.numel() > 0
        and local.is_contiguous()
        and not local.is_conj()
        and not local.is_neg()
    )


class Boxes:
    """The direct DTensors of one component: ``take`` during decoding (the check pass),
    ``at_own_paths`` on the decoded tree, ``land`` after the load, ``close`` always."""

    def __init__(self, reader: StepReader) -> None:
        self.reader = reader
        self.boxes: dict[str, _Box] = {}
        self._pins: dict[str, PinnedFile | None] = {}
        self._strategies: dict[str, Strategy] = {}
        self._buffers: list[memoryview] = []
        self._taken = Taken()

    def keys(self) -> set[tuple[Any, ...]]:
        """``alias_key`` of every direct local shard (what a backup keeps by reference)."""
        return {alias_key(b.local) for b in self.boxes.values()}

    def take(self, name: str, template: Any, sharded: ShardedTensor) -> torch.Tensor | None:
        """``template`` itself if its local shard can take its stored box directly (``check``
        then checks the blocks); None to read it the usual way (which also reports a
        shape mismatch or a damaged entry). Raises CorruptCheckpointError."""
        from checkpointd.format.dtypes import decode_dtype

        if name in self.boxes or tuple(sharded.shape) != tuple(template.shape):
            return None
        if any(shard.blob for shard in sharded.shards):
            return None  # shards in shared blobs (incremental saves): read the usual way
        if template.device.type != "cpu" and transfer_for(template.device) is None:
            return None
        dtype = decode_dtype(sharded.dtype)
        if dtype is None:
            return None  # the usual read reports the unknown dtype
        local, box = template.to_local(), local_box(template)
        if not _fits(local, dtype, box):
            return None
        item = _Box(name, template, local, box, dtype)
        for shard in sharded.shards:
            part = intersect((tuple(shard.offsets), tuple(shard.shape)), box)
            if part is None or 0 in part[1]:
                continue
            span = self.reader.shard_blocks(shard, dtype, part)
            run, local_run = (
                run_in((tuple(shard.offsets), tuple(shard.shape)), part),
                run_in(box, part),
            )
            size = dtype.itemsize
            contiguous = None
            if run is not None and local_run is not None:
                contiguous = (run[0] * size, run[1] * size, local_run[0] * size)
            item.parts.append(_Part(shard, part, span.lo, span.hi, span.total, contiguous))
        if sum(math.prod(p.part[1]) for p in item.parts) != local.numel():
            return None  # the shards do not cover the box: the usual path reports it
        if not self._taken.take(local, local.nbytes):
            return None  # overlaps another direct local shard's memory
        self.boxes[name] = item
        live: torch.Tensor = template
        return live

    def _pin(self, file: str) -> PinnedFile | None:
        if file not in self._pins:
            try:
                self._pins[file] = self.reader.store.open_pinned(f"{self.reader.folder}/{file}")
                if self._pins[file] is not None:
                    self.reader.check_size(file)
            except StorageNotFoundError:
                raise self.reader.vanished(file) from None
        return self._pins[file]

    def _read(self, file: str) -> Any:
        pinned = self._pins[file]
        assert pinned is not None

        def read(view: memoryview, offset: int) -> None:
            try:
                pinned.read_into(view, offset)
            except StorageNotFoundError:
                raise self.reader.vanished(file) from None

        return read

    def _buffer(self, i: int, size: int) -> memoryview:
        """Reused block buffer ``i`` (0 or 1), at least ``size`` bytes."""
        while len(self._buffers) <= i:
            self._buffers.append(memoryview(b""))
        if len(self._buffers[i]) < size:
            self._buffers[i] = memoryview(bytearray(size))
        return self._buffers[i][:size]

    def _blocks(self, piece: _Part) -> list[tuple[int, int]]:
        """(begin, end) in the shard's bytes of each block holding ``piece``."""
        block, total = piece.shard.block_bytes, piece.total
        return [(i * block, min((i + 1) * block, total)) for i in range(piece.lo, piece.hi)]

    def _by_file(self) -> dict[str, list[tuple[_Box, _Part]]]:
        """Every piece by shard file, in file order (one stream per file)."""
        found: dict[str, list[tuple[_Box, _Part]]] = {}
        for item in self.boxes.values():
            for piece in item.parts:
                found.setdefault(piece.shard.file, []).append((item, piece))
        for pieces in found.values():
            pieces.sort(key=lambda p: p[1].shard.begin + p[1].lo * p[1].shard.block_bytes)
        return found

    def check(self) -> None:
        """The check pass (module doc, step 1) over every piece taken, each file's
        strategy chosen: where it checks before landing, the blocks of a pinned file
        are streamed through the two block buffers and checked (one stream per file);
        ``WHOLE``: its part is read into fresh memory, checked and kept.
        CorruptCheckpointError if a block differs; nothing live changes."""
        for file, pieces in self._by_file().items():
            pinned = self._pin(file)
            on_device = any(needs_bounce(item.local) for item, _ in pieces)
            strategy = self._strategies[file] = choose(pinned, on_device)
            if strategy is WHOLE:
                for item, piece in pieces:
                    piece.kept = self.reader.shard_part(piece.shard, item.dtype, piece.part)
                continue
            if not self.reader.verify or not strategy.checked_before:
                continue  # checked as they land
            blocks = [
                (piece, index, piece.shard.begin + begin, end - begin)
                for _, piece in pieces
                for index, (begin, end) in zip(
                    range(piece.lo, piece.hi), self._blocks(piece), strict=True
                )
            ]
            if not blocks:
                continue
            # Blocks next to each other in the file are read together, as many as fit
            # in the buffers the largest block needs anyway (fresh memory costs faults).
            fits = max(size for *_, size in blocks)
            reads: list[list[int]] = []  # [file offset, bytes, block bytes...] per read
            for _, _, at, size in blocks:
                last = reads[-1] if reads else None
                if last and last[0] + last[1] == at and last[1] + size <= fits:
                    last[1] += size
                    last.append(size)
                else:
                    reads.append([at, size, size])
            owners = [(piece, index) for piece, index, _, _ in blocks]
            spans: list[Span] = [
                (self._buffer(i % 2, size), at) for i, (at, size, *_) in enumerate(reads)
            ]
            digests = crc32c_each(spans, self._read(file), pieces=[r[2:] for r in reads])
            for (piece, index), digest in zip(owners, digests, strict=True):
                self.reader.check_block(piece.shard, index, digest)

    def at_own_paths(self, tree: Any) -> bool:
        """Whether ``tree`` holds each direct DTensor exactly once, at the path it was
        taken for: then loading it writes no live tensor's old value anywhere else."""
        by_id = {id(b.live): b.name for b in self.boxes.values()}
        if len(by_id) != len(self.boxes):
            return False
        seen: dict[str, int] = {}
        for path, leaf in walk(tree):
            name = by_id.get(id(leaf))
            if name is not None:
                if "/".join(path) != name:
                    return False
                seen[name] = seen.get(name, 0) + 1
        return all(seen.get(name) == 1 for name in self.boxes)

    def land(self, where: str, staging: Bounce) -> None:
        """Read every direct box into its local shard (see the module doc, step 3), in
        the way ``check`` chose for its file; ``BOUNCED`` ones go through ``staging``."""
        for file, pieces in self._by_file().items():
            strategy = self._strategies[file]
            if strategy is BOUNCED or strategy is BOUNCED_MAPPED:
                self._land_bounced(where, file, pieces, staging)
            elif strategy is CHECKED_COPY:
                mapped = self._pins[file]
                assert isinstance(mapped, MappedFile)
                self._land_mapped(where, file, mapped, pieces)
            else:
                self._land_file(where, file, pieces, strategy)
        for item in self.boxes.values():
            torch.autograd.graph.increment_version(item.local)

    def _land_file(
        self, where: str, file: str, pieces: list[tuple[_Box, _Part]], strategy: Strategy
    ) -> None:
        """``land`` for the pieces of one ``REREAD`` or ``WHOLE`` shard file: kept ones
        copied, strided ones read fresh (checked) and copied, each contiguous one read
        straight into its local shard in one read (its blocks were checked by the check
        pass); then CorruptCheckpointError unless a pinned file is still unchanged."""
        for item, piece in pieces:
            if piece.kept is not None or piece.contiguous is None:
                self._land_copied(file, item, piece)
                continue
            begin, end, at = piece.contiguous
            local = bytes_of(item.local)[at : at + end - begin]
            self._read(file)(local, piece.shard.begin + begin)
        if strategy.pinned_unchanged and (pinned := self._pins.get(file)) is not None:
            require_unchanged(where, file, pinned)

    def _land_mapped(
        self, where: str, file: str, mapped: MappedFile, pieces: list[tuple[_Box, _Part]]
    ) -> None:
        """``land`` for a ``CHECKED_COPY`` file (module doc): each block of a contiguous part
        copied into its local shard and checked as it landed; others as ``_land_copied``."""
        groups: list[list[tuple[int | None, memoryview]]] = []
        owners: list[tuple[_Box, _Part, int]] = []
        for item, piece in pieces:
            if piece.kept is not None or piece.contiguous is None:
                self._land_copied(file, item, piece)
                continue
            begin, end, at = piece.contiguous
            address, base = item.local.data_ptr() + at - begin, piece.shard.begin
            for index, (lo, hi) in zip(range(piece.lo, piece.hi), self._blocks(piece), strict=True):
                owners.append((item, piece, index))
                a, b = max(lo, begin), min(hi, end)  # the block's bytes that land
                cuts = ((None, lo, a), (address + a, a, b), (None, b, hi))
                groups.append(
                    [(d, v) for d, x, y in cuts if x < y for v in mapped.views(base + x, y - x)]
                )
        if groups:
            digests = bytecopy.copy_checked_each(groups)
            self._check_landed(
                where, file, owners, digests, "the copy in memory changed after it was written"
            )

    def _land_bounced(
        self, where: str, file: str, pieces: list[tuple[_Box, _Part]], staging: Bounce
    ) -> None:
        """``land`` for a ``BOUNCED`` file (local shards on a device): every block of a contiguous part
        is read into one of ``staging``'s blocks, checked there and copied to the device."""
        items: list[memoryview | Block] = []
        owners: list[tuple[_Box, _Part, int]] = []
        for item, piece in pieces:
            if piece.kept is not None or piece.contiguous is None:
                self._land_copied(file, item, piece)
                continue
            begin, end, at = piece.contiguous
            flat = item.local.detach().reshape(-1).view(torch.uint8)
            for index, (lo, hi) in zip(range(piece.lo, piece.hi), self._blocks(piece), strict=True):
                owners.append((item, piece, index))
                a, b = max(lo, begin), min(hi, end)
                dst = flat[at + a - begin : at + b - begin]
                items.append(Block(hi - lo, piece.shard.begin + lo, ((dst, a - lo, b - lo),)))
        if items:
            digests = staging.run(self._read(file), items, chained=False)
            self._check_landed(
                where, file, owners, digests, "the file changed while it was being restored"
            )

    def _land_copied(self, file: str, item: _Box, piece: _Part) -> None:
        """Land a piece kept by the check pass, or one strided in the shard or the local
        shard (read fresh through the pin, checked, then copied)."""
        if piece.kept is not None:
            item.local[self._where(item.box, piece.part)].copy_(piece.kept)
            return
        fresh = self.reader.shard_part(piece.shard, item.dtype, piece.part, self._read(file))
        item.local[self._where(item.box, piece.part)].copy_(fresh)

    def _check_landed(
        self,
        where: str,
        file: str,
        owners: list[tuple[_Box, _Part, int]],
        digests: list[int],
        why: str,
    ) -> None:
        """CorruptCheckpointError unless every landed block's digest is the manifest's."""
        for (item, piece, index), digest in zip(owners, digests, strict=True):
            expected = piece.shard.crc32c[index]
            if digest != expected:
                raise CorruptCheckpointError(
                    f"{where}/{file}: CRC32C {digest:08x} of block {index} of the shard at "
                    f"{piece.shard.offsets} read into the live tensor {item.name!r} does not "
                    f"match the manifest's {expected:08x} ({why})"
                )

    @staticmethod
    def _where(box: Box, part: Box) -> tuple[slice, ...]:
        return tuple(
            slice(o - b, o - b + n) for o, n, b in zip(part[0], part[1], box[0], strict=True)
        )

    def close(self) -> None:
        """Close the pinned shard files and drop what was kept."""
        pins, self._pins, self._strategies = self._pins, {}, {}
        for pinned in pins.values():
            if pinned is not None:
                pinned.close()
        for item in self.boxes.values():
            for piece in item.parts:
                piece.kept = None
        self._buffers = []
