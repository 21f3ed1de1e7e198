"""Reading the files of one committed step: the one reader of the on-storage format.

``StepReader`` checks a file's size against the manifest before parsing a byte of it, and
(with ``verify``) its CRC32C; it reads tensor headers alone (inspect), whole tensor files
(load, restore, export), component trees and (``indexes``) shard index files; ``verify_file``
streams a file through CRC32C with a progress callback (verify). Torch is imported only by
the methods that build tensors, so verifying a root does not load it. Blocking; any thread.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from checkpointd import tunables
from checkpointd.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StorageNotFoundError,
)
from checkpointd.format.checksum import crc32c
from checkpointd.format.layout import blob_path
from checkpointd.format.manifest import (
    MANIFEST_NAME,
    BlobEntry,
    ComponentEntry,
    FileEntry,
    Manifest,
    ShardedTensor,
    ShardEntry,
    step_dirname,
)
from checkpointd.memory.hostmem import read_checked
from checkpointd.read import catalog
from checkpointd.read.component_tensors import ComponentTensors, Take
from checkpointd.read.indexes import ShardIndexes
from checkpointd.storage import Store

if TYPE_CHECKING:
    import torch

    from checkpointd.format.header import TensorEntry
    from checkpointd.state.shards import Box

__all__ = ["ShardSpan", "StepReader"]


class ShardSpan(NamedTuple):
    """Where a box lies in one shard: the shard's element strides, the first and last
    element of the box (row-major in the shard), the blocks [lo, hi) holding them and
    the shard's size in bytes."""

    strides: tuple[int, ...]
    first: int
    last: int
    lo: int
    hi: int
    total: int


class StepReader:
    """Reads and checks the files of one committed step, as listed by its manifest."""

    def __init__(self, store: Store, step: int, manifest: Manifest, *, verify: bool = True) -> None:
        self.store = store
        self.step = step
        self.manifest = manifest
        self.folder = step_dirname(step)
        self.where = catalog.step_path(store, step)
        self.files: dict[str, FileEntry] = {f.path: f for f in manifest.files}
        self.blobs: dict[str, BlobEntry] = {b.name: b for b in manifest.blobs}
        self.verify = verify
        self._sized: set[str] = set()  # files whose size was checked
        self.indexes = ShardIndexes(self)  # a schema 4 step's shard entries, read when needed

    def _size(self, name: str) -> int:
        """The file's size after checking it against the manifest (missing: ``vanished``)."""
        entry = self.files[name]
        try:
            size = self.store.size(f"{self.folder}/{name}")
        except StorageNotFoundError:
            raise self.vanished(name) from None
        if size != entry.size:
            raise CorruptCheckpointError(
                f"{self.where}/{name}: size {size} does not match the manifest's {entry.size}"
            )
        return size

    def vanished(self, name: str) -> CheckpointError:
        """The error for listed file ``name`` found missing: CheckpointNotFoundError if the
        whole step was deleted meanwhile, else CorruptCheckpointError."""
        if not self.store.exists(f"{self.folder}/{MANIFEST_NAME}"):
            # Retention (or gc) deleted the checkpoint while we were reading it.
            return CheckpointNotFoundError(
                f"step {self.step} ({self.where}) was deleted while it was being read; "
                "load again to get the newest step"
            )
        return CorruptCheckpointError(f"{self.where}/{name}: listed in manifest but missing")

    def read(self, name: str, *, keep: bool = False) -> torch.Tensor:
        """The whole file as a uint8 tensor, after the size and digest checks; with
        ``keep`` its memory is kept for a later load once freed (``host_buffer``).

        A file that disappears at any point of the read (size, open, map or read)
        is CheckpointNotFoundError if the step's manifest is gone too (retention
        deletes the manifest first), else CorruptCheckpointError.
        """
        from checkpointd.memory.hostmem import host_buffer, prefault

        path = f"{self.folder}/{name}"
        size = self.files[name].size
        # Read, never mapped, even where the store could (capabilities.memory_map): a
        # tensor over a map pins a deleted checkpoint's disk space for as long as an
        # object keeps it (an optimizer keeps its state), and on NFS it can SIGBUS.
        # One allocation per file, faulted in by the reading threads unless kept (hostmem.py).
        data, fresh = host_buffer(size, keep=keep)
        try:
            large = self.verify and size >= 2 * tunables.READ_CHUNK_BYTES
            pinned = self.store.open_pinned(path) if large else None
            if pinned is not None:
                try:
                    self._size(name)
                    self.check_digest(name, read_checked(pinned, data, fresh=fresh))
                finally:
                    pinned.close()
                return data
            view = data.numpy().data.cast("B")
            if fresh:
                prefault(data.data_ptr(), size)
            self._read_sized(name, view)
        except StorageNotFoundError:
            raise self.vanished(name) from None
        if self.verify:
            self.check_digest(name, crc32c(view))
        return data

    def _read_sized(self, name: str, view: memoryview, offset: int = 0) -> None:
        """Fill ``view`` from ``offset`` of listed file ``name``, checking its size against
        the manifest on the way (one request on an object store: no separate HEAD)."""
        size = self.store.read_into_sized(f"{self.folder}/{name}", view, offset)
        if size != self.files[name].size:
            raise CorruptCheckpointError(
                f"{self.where}/{name}: size {size} does not match the manifest's "
                f"{self.files[name].size}"
            )
        self._sized.add(name)

    def check_size(self, name: str) -> None:
        """Check listed file ``name``'s size against the manifest, once per reader."""
        if name not in self._sized:
            self._size(name)
            self._sized.add(name)

    def check_digest(self, name: str, actual: int) -> None:
        """CorruptCheckpointError unless ``actual`` is file ``name``'s CRC32C in the manifest."""
        expected = self.files[name].crc32c
        if actual != expected:
            raise CorruptCheckpointError(
                f"{self.where}/{name}: CRC32C {actual:08x} does not match the "
                f"manifest's {expected:08x}"
            )

    def header(self, name: str) -> list[TensorEntry]:
        """The tensor entries of a tensor file, reading only its length prefix and header."""
        return self.layout(name)[1]

    def layout(self, name: str) -> tuple[int, list[TensorEntry]]:
        """(where the data region starts, the tensor entries) of a tensor file, after its
        size check, reading only its length prefix and header (not checked against the
        file's CRC32C: the caller streams the whole file through it before trusting it)."""
        from checkpointd.format.header import header_length, parse_safetensors_header

        path, at = f"{self.folder}/{name}", f"{self.where}/{name}"
        size = self._size(name)
        try:
            length = header_length(self.store.read_bytes(path, 0, 8), size, where=at)
            header = self.store.read_bytes(path, 8, length)
        except StorageNotFoundError:
            raise self.vanished(name) from None
        return 8 + length, parse_safetensors_header(header, size - 8 - length, where=at)

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """Every tensor of a tensor file, as views of one buffer read in a single pass."""
        return self.tensors_of(name, self.read(name, keep=True))

    def layout_of(self, name: str, data: torch.Tensor) -> tuple[int, list[TensorEntry]]:
        """As ``layout``, parsed from the whole file ``data`` already read and checked."""
        from checkpointd.format.header import header_length, parse_safetensors_header

        where = f"{self.where}/{name}"
        length = header_length(bytes(data[:8].numpy()), data.numel(), where=where)
        start = 8 + length
        entries = parse_safetensors_header(
            bytes(data[8:start].numpy()), data.numel() - start, where=where
        )
        return start, entries

    def tensors_of(self, name: str, data: torch.Tensor) -> dict[str, torch.Tensor]:
        """As ``tensors``, from the whole file ``data`` already read and checked."""
        start, entries = self.layout_of(name, data)
        tensors: dict[str, torch.Tensor] = {}
        for entry in entries:
            chunk = data[start + entry.begin : start + entry.end]
            if (start + entry.begin) % entry.dtype.itemsize:
                chunk = chunk.clone()  # misaligned for this dtype: copy to an aligned buffer
            tensors[entry.name] = chunk.view(entry.dtype).view(entry.shape)
        return tensors

    def component(
        self,
        name: str,
        entry: ComponentEntry | None = None,
        templates: Mapping[str, Any] | None = None,
        *,
        tree: bytes | None = None,
        preloaded: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
        take: Take | None = None,
    ) -> Any:
        """The state tree of component ``name``, its tensors read and checked.

        Sharded tensors are assembled whole, except those named in ``templates``
        (tensor name -> a live DTensor): each of those comes back as a DTensor like
        its template, holding only this rank's part, read from the shards it overlaps.
        ``tree``: the component's tree file, already read and checked (else read here).
        ``preloaded[file]``: the tensors of a tensor file the caller already read and
        checked (restore's in-place path), used instead of reading that file.
        ``take``: see ``ComponentTensors`` (restore's DTensor path).
        """
        from checkpointd.format.codec import decode_tree

        entry = self.manifest.components[name] if entry is None else entry
        tensors = ComponentTensors(self, entry, templates or {}, preloaded or {}, take)
        if tree is None:
            tree = self.tree(entry)
        return decode_tree(tree, tensors, where=f"{self.where}/{entry.tree}")

    def tree(self, entry: ComponentEntry) -> bytes:
        """A component's tree file, after its size and digest checks."""
        return bytes(self.read(entry.tree).numpy())

    def region(self, name: str, sharded: ShardedTensor, box: Box) -> torch.Tensor:
        """The ``box`` (offsets, shape) of sharded tensor ``name``, read from the shards that
        overlap it: whole blocks of each, each block checked against its CRC32C."""
        import torch

        from checkpointd.format.dtypes import decode_dtype
        from checkpointd.state.shards import intersect

        dtype = decode_dtype(sharded.dtype)
        if dtype is None:
            raise CorruptCheckpointError(
                f"{self.where}: tensor {name!r}: unknown dtype {sharded.dtype!r}"
            )
        parts = [
            (shard, part)
            for shard in sharded.shards
            if (part := intersect((tuple(shard.offsets), tuple(shard.shape)), box)) is not None
            and 0 not in part[1]
        ]
        if len(parts) == 1 and parts[0][1] == box:
            return self.shard_part(parts[0][0], dtype, box)  # one shard holds it: no copy
        out = torch.empty(box[1], dtype=dtype)
        for shard, part in parts:
            where = tuple(
                slice(o - b, o - b + n) for o, n, b in zip(part[0], part[1], box[0], strict=True)
            )
            out[where] = self.shard_part(shard, dtype, part)
        return out

    def shard_blocks(self, shard: ShardEntry, dtype: torch.dtype, part: Box) -> ShardSpan:
        """Where ``part`` (global coordinates, inside ``shard``) lies in the shard's bytes,
        after a check that the manifest lists a digest for every block (else
        CorruptCheckpointError)."""
        strides = [1] * len(shard.shape)
        for d in range(len(shard.shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shard.shape[d + 1]
        inner = [o - s for o, s in zip(part[0], shard.offsets, strict=True)]
        first = sum(i * s for i, s in zip(inner, strides, strict=True))
        last = first + sum((n - 1) * s for n, s in zip(part[1], strides, strict=True))
        size = dtype.itemsize
        total = size * math.prod(shard.shape)
        block = shard.block_bytes
        lo, hi = first * size // block, -(-(last + 1) * size // block)
        if hi > len(shard.crc32c) or total > shard.block_bytes * len(shard.crc32c):
            raise CorruptCheckpointError(
                f"{self.where}/{shard.file or blob_path(shard.blob)}: the shard at "
                f"{shard.offsets} has too few block digests"
            )
        return ShardSpan(tuple(strides), first, last, lo, hi, total)

    def check_block(self, shard: ShardEntry, index: int, actual: int) -> None:
        """CorruptCheckpointError unless ``actual`` is block ``index``'s CRC32C."""
        if actual != shard.crc32c[index]:
            raise CorruptCheckpointError(
                f"{self.where}/{shard.file or blob_path(shard.blob)}: block {index} of the shard at "
                f"{shard.offsets} has CRC32C {actual:08x}, the manifest "
                f"{shard.crc32c[index]:08x}"
            )

    def shard_part(
        self,
        shard: ShardEntry,
        dtype: torch.dtype,
        part: Box,
        read: Callable[[memoryview, int], None] | None = None,
    ) -> torch.Tensor:
        """As ``region`` for one shard's ``part``: a strided view of fresh memory holding
        the whole blocks of the shard that overlap it, each checked (with ``verify``).
        ``read(view, offset)``: how to read the shard file (default: by path, checking
        its size on the first read of each file; a caller passing ``read`` checks it)."""
        import torch

        span = self.shard_blocks(shard, dtype, part)
        block = shard.block_bytes
        begin, end = span.lo * block, min(span.hi * block, span.total)
        data = torch.empty(end - begin, dtype=torch.uint8)
        view = data.numpy().data.cast("B")
        path = f"{self.folder}/{shard.file}"
        try:
            if shard.blob:  # ``read`` is for step files only
                self.store.read_into(self._blob_shard(shard, span.total), view, begin)
            elif read is None and shard.file not in self._sized:
                self._read_sized(shard.file, view, shard.begin + begin)
            elif read is None:
                self.store.read_into(path, view, shard.begin + begin)
            else:
                read(view, shard.begin + begin)
        except StorageNotFoundError:
            raise self.vanished(shard.file or shard.blob) from None
        if self.verify:
            for index in range(span.lo, span.hi):
                at = index * block - begin
                self.check_block(shard, index, crc32c(view[at : at + block]))
        flat = data.view(dtype)
        offset = flat.storage_offset() + span.first - begin // dtype.itemsize
        return flat.as_strided(part[1], span.strides, offset)

    def _blob_shard(self, shard: ShardEntry, nbytes: int) -> str:
        """``shard``'s blob, its size checked against the manifest on its first read."""
        if shard.blob not in self._sized:
            size, listed = self.store.size(blob_path(shard.blob)), self.blobs[shard.blob].size
            if not nbytes == size == listed:
                raise CorruptCheckpointError(
                    f"{self.where}: blob {shard.blob} holds {size} bytes, the manifest lists "
                    f"{listed}, the shard at {shard.offsets} needs {nbytes}"
                )
            self._sized.add(shard.blob)
        return blob_path(shard.blob)

    def blob_tensor(
        self, blob: str, dtype_text: str, shape: list[int], tensor: str
    ) -> torch.Tensor:
        """Tensor ``tensor`` stored as shared blob ``blob`` (``dtype_text`` in either spelling,
        ``shape``), after the size and (with ``verify``) digest checks: the name is the
        XXH3-128 of the bytes. A missing blob is damage to this checkpoint
        (CheckpointNotFoundError if the checkpoint itself was deleted meanwhile)."""
        import math

        import torch

        from checkpointd.format.dtypes import decode_dtype
        from checkpointd.format.header import shape_fits

        entry = self.blobs[blob]
        at = f"{self.store.url.rstrip('/')}/{blob_path(blob)}"
        dtype = decode_dtype(dtype_text)
        if dtype is None or not shape_fits(shape):
            raise CorruptCheckpointError(f"{self.where}: bad dtype or shape for {tensor!r}")
        if math.prod(shape) * dtype.itemsize != entry.size:
            raise CorruptCheckpointError(
                f"{self.where}: {tensor!r} needs {math.prod(shape) * dtype.itemsize} bytes, "
                f"blob {blob} is listed with {entry.size}"
            )
        try:
            size = self.store.size(blob_path(blob))
            if size != entry.size:
                raise CorruptCheckpointError(
                    f"{at} (used by {self.where}): size {size} does not match the manifest's "
                    f"{entry.size}"
                )
            data = torch.empty(size, dtype=torch.uint8)
            view = data.numpy().data.cast("B")
            self.store.read_into(blob_path(blob), view)
        except StorageNotFoundError:
            if not self.store.exists(f"{self.folder}/{MANIFEST_NAME}"):
                raise self.vanished(blob) from None
            raise CorruptCheckpointError(
                f"{at} (used by {self.where}): listed in the manifest but missing"
            ) from None
        if self.verify:
            from checkpointd.format.digest import blob_name

            actual = blob_name(view)
            if actual != blob:
                raise CorruptCheckpointError(
                    f"{at} (used by {self.where}): its bytes hash to {actual}, not its name"
                )
        return data.view(dtype).view(shape)
