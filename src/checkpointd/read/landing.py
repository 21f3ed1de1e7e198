"""The two passes over a tensor file some of whose tensors restore straight into live
tensors (inplace.py says why the order is all or nothing), in the way its ``Landing``'s
strategy names (strategies.py, chosen once when the landing is made): the check pass
copies the header and the other tensors out (checking the file's CRC32C on the way
where the strategy checks before landing); the landing pass puts the direct tensors'
bytes in the live tensors. Blocking; the restoring thread (plus helper threads)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from checkpointd import tunables
from checkpointd.errors import CorruptCheckpointError, StorageNotFoundError
from checkpointd.format.checksum import crc32c_stream
from checkpointd.format.header import TensorEntry
from checkpointd.memory import bytecopy
from checkpointd.read.bounce import Bounce, Piece, needs_bounce
from checkpointd.read.reader import StepReader
from checkpointd.read.strategies import (
    BOUNCED,
    BOUNCED_MAPPED,
    CHECKED_COPY,
    WHOLE,
    Strategy,
    choose,
)
from checkpointd.storage.base import MappedFile, PinnedFile

__all__ = ["Landing", "bytes_of", "check_pass", "land_file", "require_unchanged"]

_ALIGN = 64
"""Alignment of each tensor copied out into fresh memory during the check pass."""


@dataclass
class Landing:
    """One tensor file some of whose tensors land straight in live tensors (``entries`` in
    file order; ``crc32c`` the manifest's), opened as ``pinned`` or read whole as
    ``source``; ``strategy`` is chosen from those when it is made."""

    file: str
    start: int
    entries: list[TensorEntry]
    direct: dict[str, torch.Tensor]
    crc32c: int
    header: bytes = b""
    kept: list[memoryview] = field(default_factory=list)
    """Byte views of the tensors that do not land directly, in file order."""
    pinned: PinnedFile | None = None
    source: torch.Tensor | None = None
    strategy: Strategy = field(init=False)

    def __post_init__(self) -> None:
        on_device = any(needs_bounce(live) for live in self.direct.values())
        self.strategy = choose(self.pinned, on_device)


def bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    return flat.numpy().data.cast("B")


def _reader(reader: StepReader, landing: Landing) -> Callable[[memoryview, int], None]:
    pinned = landing.pinned
    assert pinned is not None

    def read(view: memoryview, offset: int) -> None:
        try:
            pinned.read_into(view, offset)
        except StorageNotFoundError:
            raise reader.vanished(landing.file) from None

    return read


def check_pass(reader: StepReader, landing: Landing) -> dict[str, torch.Tensor]:
    """The check pass: ``landing``'s header and non-direct tensors copied out (those
    tensors by name), its file checked against its CRC32C through two reused chunk
    buffers on the way where its strategy checks before landing (strategies.py). A
    file read whole (``WHOLE``) was checked when read and is kept until landing."""
    size = reader.files[landing.file].size
    others = [e for e in landing.entries if e.name not in landing.direct]
    pinned, strategy = landing.pinned, landing.strategy
    if strategy is WHOLE:
        return _whole_others(landing, others)
    offsets = [0, *itertools.accumulate(-(-(e.end - e.begin) // _ALIGN) * _ALIGN for e in others)]
    total = offsets.pop()
    memory = torch.empty(total, dtype=torch.uint8)
    out = memory.numpy().data.cast("B") if total else memoryview(b"")
    # (file begin, file end, destination) of what is copied out of each chunk, in order.
    copies: list[tuple[int, int, int | None]] = [(0, landing.start, None)] + [
        (landing.start + e.begin, landing.start + e.end, at)
        for e, at in zip(others, offsets, strict=True)
    ]
    header = bytearray(landing.start)
    chunk = min(tunables.READ_CHUNK_BYTES, max(size, 1))
    assert pinned is not None
    spans: list[tuple[memoryview, int | None]]
    if not strategy.checked_before:  # a MappedFile, in memory already: checked as it lands
        assert isinstance(pinned, MappedFile)
        spans = [(piece, None) for piece in pinned.views(0, size)]
    else:
        buffers = [memoryview(bytearray(chunk)), memoryview(bytearray(chunk))]
        spans = [
            (buffers[i % 2][: min(chunk, size - offset)], offset)
            for i, offset in enumerate(range(0, size, chunk))
        ]
    starts = list(itertools.accumulate((len(view) for view, _ in spans), initial=0))
    cursor = 0

    def extract(i: int, view: memoryview) -> None:
        nonlocal cursor
        lo, hi = starts[i], starts[i] + len(view)
        while cursor < len(copies) and copies[cursor][1] <= lo:
            cursor += 1
        j = cursor
        while j < len(copies) and copies[j][0] < hi:
            begin, end, at = copies[j]
            a, b = max(begin, lo), min(end, hi)
            if a < b:
                if at is None:
                    header[a:b] = view[a - lo : b - lo]
                else:
                    out[at + a - begin : at + b - begin] = view[a - lo : b - lo]
            j += 1

    if strategy.checked_before:
        reader.check_digest(landing.file, crc32c_stream(spans, _reader(reader, landing), extract))
        landing.header = bytes(header)
    else:
        for i, (view, _) in enumerate(spans):
            extract(i, view)
        landing.header = bytes(header)
        _require_planned_layout(reader, landing)
    landing.kept = [out[at : at + e.end - e.begin] for e, at in zip(others, offsets, strict=True)]
    return {
        e.name: memory[at : at + e.end - e.begin].view(e.dtype).view(e.shape)
        for e, at in zip(others, offsets, strict=True)
    }


def _whole_others(landing: Landing, others: list[TensorEntry]) -> dict[str, torch.Tensor]:
    """``check_pass`` of a file read whole (and checked) by ``inplace._open``."""
    source = landing.source
    assert source is not None
    landing.header = bytes(source[: landing.start].numpy())
    kept: dict[str, torch.Tensor] = {}
    for e in others:
        piece = source[landing.start + e.begin : landing.start + e.end]
        if (landing.start + e.begin) % e.dtype.itemsize:
            piece = piece.clone()
        kept[e.name] = piece.view(e.dtype).view(e.shape)
    return kept


def _require_planned_layout(reader: StepReader, landing: Landing) -> None:
    """CorruptCheckpointError unless the header just copied out of a file not checked
    before landing (the one ``land_file`` checks) lays the file out as the header read
    before it did (the one the landing was planned on): the memory of a ``MappedFile``
    may be written into between the two."""
    from checkpointd.format.header import header_length, parse_safetensors_header

    where, size = f"{reader.where}/{landing.file}", reader.files[landing.file].size
    header = landing.header
    length = header_length(header[:8], size, where=where)
    entries = None
    if 8 + length == landing.start == len(header):
        entries = parse_safetensors_header(header[8:], size - landing.start, where=where)
    if entries is None or sorted(entries, key=lambda e: e.begin) != landing.entries:
        raise CorruptCheckpointError(
            f"{where}: the header changed after it was read (the copy in memory was "
            "written into while it was being restored)"
        )


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor on its device."""
    return tensor.detach().reshape(-1).view(torch.uint8)


def land_file(where: str, landing: Landing, staging: Bounce | None = None) -> None:
    """Land the direct tensors of one file (``where``: the step, for messages) in the
    way its strategy names (strategies.py); ``BOUNCED`` ones through ``staging`` (else
    one of its own). CorruptCheckpointError if what landed is not what was checked."""
    source, pinned, strategy = landing.source, landing.pinned, landing.strategy
    if strategy is WHOLE:  # read whole and checked in the check pass
        assert source is not None
        for e in landing.entries:
            live = landing.direct.get(e.name)
            if live is not None:
                _flat(live).copy_(source[landing.start + e.begin : landing.start + e.end])
        return
    assert pinned is not None
    if strategy is BOUNCED or strategy is BOUNCED_MAPPED:
        with Bounce() as own:  # allocates nothing unless used
            digest = _bounce(landing, pinned, staging or own)
            _check_landed(where, landing, digest, "the file changed while it was being restored")
        return
    if strategy is CHECKED_COPY:
        assert isinstance(pinned, MappedFile)
        digest = bytecopy.copy_checked(_mapped_pieces(landing, pinned))
        _check_landed(where, landing, digest, "the copy in memory changed after it was written")
        return
    for e in landing.entries:  # REREAD
        if (live := landing.direct.get(e.name)) is not None:
            pinned.read_into(bytes_of(live), landing.start + e.begin)
    require_unchanged(where, landing.file, pinned)


def _mapped_pieces(landing: Landing, mapped: MappedFile) -> list[tuple[int | None, memoryview]]:
    """A mapped file's bytes in order for ``copy_checked`` (a tensor file is its header,
    then its tensors with no gaps: header.py checks that): the header and the non-direct
    tensors as the check pass copied them out (what was loaded is what is checked), each
    direct tensor's bytes from the mapping with its live tensor's address."""
    pieces: list[tuple[int | None, memoryview]] = [(None, memoryview(landing.header))]
    kept = iter(landing.kept)
    for e in landing.entries:
        live = landing.direct.get(e.name)
        if live is None:
            pieces.append((None, next(kept)))
            continue
        address = live.data_ptr()
        for view in mapped.views(landing.start + e.begin, e.end - e.begin):
            pieces.append((address, view))
            address += len(view)
    return pieces


def require_unchanged(where: str, file: str, pinned: PinnedFile) -> None:
    """After landing checked bytes read again from ``pinned`` (``file`` of step ``where``):
    CorruptCheckpointError unless nothing has written into it since it was opened."""
    if not pinned.unchanged():
        raise CorruptCheckpointError(
            f"{where}/{file}: the file changed while it was being restored (it was "
            "written into after its CRC32C was checked)"
        )


def _bounce(landing: Landing, pinned: PinnedFile, staging: Bounce) -> int:
    """Land a file's direct tensors through the bounce buffer (each read a block at a time
    and copied to its device; the other bytes from what the check pass kept): the CRC32C
    of the whole file as it landed."""
    items: list[memoryview | Piece] = [memoryview(landing.header)]
    kept = iter(landing.kept)
    for e in landing.entries:
        live = landing.direct.get(e.name)
        items.append(next(kept) if live is None else Piece(_flat(live), landing.start + e.begin))
    return staging.stream(pinned.read_into, items)


def _check_landed(where: str, landing: Landing, digest: int, why: str) -> None:
    """CorruptCheckpointError unless ``digest``, of the bytes landed, is the file's."""
    if digest != landing.crc32c:
        raise CorruptCheckpointError(
            f"{where}/{landing.file}: CRC32C {digest:08x} of the bytes read into the "
            f"live tensors does not match the manifest's {landing.crc32c:08x} ({why})"
        )
