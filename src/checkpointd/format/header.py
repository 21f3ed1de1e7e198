"""The safetensors header of a component's tensor file: encode and parse.

A tensor file is an 8-byte little-endian header length, a JSON header naming
each tensor's dtype, shape and byte range, then the data region. The writer
pads the header so large data regions start 4 KiB-aligned (direct I/O); the
parser refuses anything a hostile file could use to read out of range.
docs/format.md is the spec.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from checkpointd import tunables
from checkpointd.errors import CorruptCheckpointError, InvalidArgumentError
from checkpointd.format.dtypes import decode_dtype, encode_dtype
from checkpointd.format.layout import HEADER_ALIGN

__all__ = [
    "TensorEntry",
    "encode_safetensors_header",
    "header_length",
    "parse_safetensors_header",
    "shape_fits",
]


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a tensor file: byte range relative to the start of the data region."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


class _HeaderEntry(msgspec.Struct, forbid_unknown_fields=True):
    dtype: str
    shape: list[int]
    data_offsets: tuple[int, int]


def encode_safetensors_header(entries: list[TensorEntry], *, align: int = HEADER_ALIGN) -> bytes:
    """Return the 8-byte length prefix and JSON header, padded so data starts ``align``-aligned.

    ``align`` is a multiple of 8; the writer passes the direct-I/O block size for
    large files so the data region can go to disk without the page cache.
    """
    if align % HEADER_ALIGN or align <= 0:
        raise InvalidArgumentError(
            f"header alignment must be a positive multiple of 8, not {align}"
        )
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "writer": "checkpointd"}}
    for entry in entries:
        header[entry.name] = {
            "dtype": encode_dtype(entry.dtype, "code"),
            "shape": list(entry.shape),
            "data_offsets": [entry.begin, entry.end],
        }
    body = msgspec.json.encode(header)
    body += b" " * (-(len(body) + 8) % align)
    return len(body).to_bytes(8, "little") + body


def header_length(prefix: bytes, file_size: int, *, where: str) -> int:
    """Validate the 8-byte length prefix against the file size; return the header's length."""
    if len(prefix) < 8 or file_size < 8:
        raise CorruptCheckpointError(f"{where}: too short for a safetensors file")
    length = int.from_bytes(prefix[:8], "little")
    if length > tunables.MAX_HEADER_BYTES or length > file_size - 8:
        raise CorruptCheckpointError(
            f"{where}: header length {length} does not fit a file of {file_size} bytes"
        )
    return length


def parse_safetensors_header(header: bytes, data_size: int, *, where: str) -> list[TensorEntry]:
    """Parse and check a safetensors JSON header against the size of the data region.

    Every tensor must lie inside the data region with the size its dtype and
    shape imply, and the tensors must cover the region without gaps or overlap.
    """
    try:
        raw = msgspec.json.decode(header.rstrip(b" "))
    except (msgspec.DecodeError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where}: malformed safetensors header ({exc})") from exc
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(f"{where}: safetensors header is not an object")
    entries: list[TensorEntry] = []
    for name, value in raw.items():
        if name == "__metadata__":
            continue
        try:
            item = msgspec.convert(value, _HeaderEntry)
        except msgspec.ValidationError as exc:
            raise CorruptCheckpointError(f"{where}: bad header entry {name!r} ({exc})") from exc
        dtype = decode_dtype(item.dtype)
        if dtype is None:
            raise CorruptCheckpointError(f"{where}: unknown dtype {item.dtype!r} for {name!r}")
        if not shape_fits(item.shape):
            raise CorruptCheckpointError(
                f"{where}: shape {item.shape} of {name!r} has a negative dimension or "
                "dimensions whose product does not fit 64 bits"
            )
        begin, end = item.data_offsets
        expected = math.prod(item.shape) * dtype.itemsize
        if not 0 <= begin <= end <= data_size or end - begin != expected:
            raise CorruptCheckpointError(
                f"{where}: tensor {name!r} has offsets {begin}..{end}, "
                f"which do not fit {expected} bytes in a data region of {data_size}"
            )
        entries.append(TensorEntry(name, dtype, tuple(item.shape), begin, end))
    position = 0
    for entry in sorted(entries, key=lambda e: (e.begin, e.end)):
        if entry.begin != position:
            raise CorruptCheckpointError(f"{where}: tensor data has a gap or overlap at {position}")
        position = entry.end
    if position != data_size:
        raise CorruptCheckpointError(
            f"{where}: {data_size - position} trailing bytes after tensors"
        )
    return entries


_INT64_MAX = 2**63 - 1


def shape_fits(shape: Sequence[int]) -> bool:
    """True if no dimension is negative and their product, a zero counted as one, fits int64.

    The rule for every stored tensor, empty ones included: torch computes strides
    as such products, so a larger shape cannot be viewed even with no elements.
    """
    product = 1
    for dim in shape:
        if dim < 0:
            return False
        product *= max(dim, 1)
        if product > _INT64_MAX:
            return False
    return True
