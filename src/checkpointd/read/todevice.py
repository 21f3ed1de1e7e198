"""``load(..., map_location=device)`` for a device the bounce path serves (bounce.py):
each tensor file's data lands in one device buffer through the shared bounce buffer,
instead of the whole checkpoint being read into host memory and then moved. The
header is read from the same pinned file, and the CRC32C of every byte (header and
data) is compared with the manifest before any tensor is handed out; on a store that
cannot pin a file, the file is read whole into host memory (checked), then copied.
Host memory: the bounce buffer (``tunables.BOUNCE_BYTES``) plus one header. Blocking;
a reading thread (the ``Bounce`` lock lets one file through at a time)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from checkpointd.errors import StorageNotFoundError
from checkpointd.format.header import TensorEntry, header_length, parse_safetensors_header
from checkpointd.read.bounce import Bounce, Piece
from checkpointd.read.reader import StepReader
from checkpointd.storage.base import PinnedFile

__all__ = ["component_on", "file_on"]


def _views(data: torch.Tensor, entries: list[TensorEntry]) -> dict[str, torch.Tensor]:
    """The tensors of a file whose data region is ``data`` (any device), by name."""
    tensors: dict[str, torch.Tensor] = {}
    for entry in entries:
        chunk = data[entry.begin : entry.end]
        if entry.begin % entry.dtype.itemsize:
            chunk = chunk.clone()  # misaligned for this dtype: copy to an aligned buffer
        tensors[entry.name] = chunk.view(entry.dtype).view(entry.shape)
    return tensors


def _header(reader: StepReader, file: str, pinned: PinnedFile) -> tuple[bytes, list[TensorEntry]]:
    """The length prefix and header of ``file`` read from ``pinned`` (after its size
    check), and its entries; trusted only once the whole file's CRC32C matches."""
    size = reader.files[file].size
    where = f"{reader.where}/{file}"
    prefix = memoryview(bytearray(min(8, size)))
    pinned.read_into(prefix, 0)
    length = header_length(bytes(prefix), size, where=where)
    header = memoryview(bytearray(8 + length))
    header[:8] = prefix
    pinned.read_into(header[8:], 8)
    return bytes(header), parse_safetensors_header(
        bytes(header[8:]), size - len(header), where=where
    )


def file_on(
    reader: StepReader, file: str, device: torch.device, bounce: Bounce
) -> dict[str, torch.Tensor]:
    """The tensors of tensor file ``file``, on ``device``, checked (size and, with the
    reader's ``verify``, CRC32C) before they are returned."""
    path = f"{reader.folder}/{file}"
    try:
        pinned = reader.store.open_pinned(path)
    except StorageNotFoundError:
        raise reader.vanished(file) from None
    if pinned is None:
        whole = reader.read(file)  # size and CRC32C checked
        start, entries = reader.layout_of(file, whole)
        data = torch.empty(whole.numel() - start, dtype=torch.uint8, device=device)
        data.copy_(whole[start:])
        return _views(data, entries)
    try:
        reader.check_size(file)
        header, entries = _header(reader, file, pinned)
        data = torch.empty(reader.files[file].size - len(header), dtype=torch.uint8, device=device)
        digest = bounce.stream(pinned.read_into, [memoryview(header), Piece(data, len(header))])
    except StorageNotFoundError:
        raise reader.vanished(file) from None
    finally:
        pinned.close()
    if reader.verify:
        reader.check_digest(file, digest)
    return _views(data, entries)


def component_on(
    reader: StepReader, name: str, device: torch.device, bounce: Bounce
) -> Mapping[str, Mapping[str, torch.Tensor]]:
    """Component ``name``'s tensor files on ``device`` by file, for
    ``StepReader.component(..., preloaded=...)`` (its blobs and shards are read the usual
    way and moved by the caller)."""
    entry = reader.manifest.components[name]
    return {file: file_on(reader, file, device, bounce) for file in entry.tensors}
