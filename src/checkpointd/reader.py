"""Reading the files of one committed step: the one reader of the on-storage format.

``StepReader`` checks a file's size against the manifest before parsing a byte
of it, and (with ``verify``) its CRC32C; it reads tensor headers alone (inspect),
whole tensor files (load, restore, export) and component trees; ``verify_file``
streams a file through CRC32C with a progress callback (verify). Torch is
imported only by the methods that build tensors, so verifying a root does not
load it. Blocking; any thread (one StepReader may serve several threads).
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from checkpointd import catalog, tunables
from checkpointd.checksum import crc32c, crc32c_combine
from checkpointd.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StorageNotFoundError,
)
from checkpointd.layout import blob_path
from checkpointd.manifest import (
    MANIFEST_NAME,
    BlobEntry,
    ComponentEntry,
    FileEntry,
    Manifest,
    ShardedTensor,
    ShardEntry,
    step_dirname,
)
from checkpointd.storage import Store
from checkpointd.storage.base import PinnedFile

if TYPE_CHECKING:
    import torch

    from checkpointd.header import TensorEntry
    from checkpointd.shards import Box

__all__ = ["StepReader", "verify_step"]

Progress = Callable[[int], None]
"""Called with the number of bytes just read (from the reading thread)."""


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
        self._sized: set[str] = set()  # shard files whose size was checked

    def _size(self, name: str) -> int:
        """The file's size after checking it against the manifest (missing: ``_vanished``)."""
        entry = self.files[name]
        try:
            size = self.store.size(f"{self.folder}/{name}")
        except StorageNotFoundError:
            raise self._vanished(name) from None
        if size != entry.size:
            raise CorruptCheckpointError(
                f"{self.where}/{name}: size {size} does not match the manifest's {entry.size}"
            )
        return size

    def _vanished(self, name: str) -> CheckpointError:
        """The error for a listed file that is not there (any more)."""
        if not self.store.exists(f"{self.folder}/{MANIFEST_NAME}"):
            # Retention (or gc) deleted the checkpoint while we were reading it.
            return CheckpointNotFoundError(
                f"step {self.step} ({self.where}) was deleted while it was being read; "
                "load again to get the newest step"
            )
        return CorruptCheckpointError(f"{self.where}/{name}: listed in manifest but missing")

    def read(self, name: str) -> torch.Tensor:
        """The whole file as a uint8 tensor, after the size and digest checks.

        A file that disappears at any point of the read (size, open, map or read)
        is CheckpointNotFoundError if the step's manifest is gone too (retention
        deletes the manifest first), else CorruptCheckpointError.
        """
        import torch

        from checkpointd.hostmem import prefault

        path = f"{self.folder}/{name}"
        size = self._size(name)
        # Read, never mapped, even where the store could (capabilities.memory_map): a
        # tensor over a map pins a deleted checkpoint's disk space for as long as an
        # object keeps it (an optimizer keeps its state), and on NFS it can SIGBUS.
        # One allocation per file, faulted in by the reading threads (hostmem.py).
        data = torch.empty(size, dtype=torch.uint8)
        try:
            large = self.verify and size >= 2 * tunables.READ_CHUNK_BYTES
            pinned = self.store.open_pinned(path) if large else None
            if pinned is not None:
                try:
                    self._check_digest(name, _read_checked(pinned, data))
                finally:
                    pinned.close()
                return data
            view = data.numpy().data.cast("B")
            prefault(data.data_ptr(), size)
            self.store.read_into(path, view)
        except StorageNotFoundError:
            raise self._vanished(name) from None
        if self.verify:
            self._check_digest(name, crc32c(view))
        return data

    def _check_digest(self, name: str, actual: int) -> None:
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
        from checkpointd.header import header_length, parse_safetensors_header

        path, at = f"{self.folder}/{name}", f"{self.where}/{name}"
        size = self._size(name)
        try:
            length = header_length(self.store.read_bytes(path, 0, 8), size, where=at)
            header = self.store.read_bytes(path, 8, length)
        except StorageNotFoundError:
            raise self._vanished(name) from None
        return 8 + length, parse_safetensors_header(header, size - 8 - length, where=at)

    def check_digest(self, name: str, actual: int) -> None:
        """CorruptCheckpointError unless ``actual`` is file ``name``'s CRC32C in the manifest."""
        self._check_digest(name, actual)

    def vanished(self, name: str) -> CheckpointError:
        """The error for listed file ``name`` found missing: CheckpointNotFoundError if the
        whole step was deleted meanwhile, else CorruptCheckpointError."""
        return self._vanished(name)

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """Every tensor of a tensor file, as views of one buffer read in a single pass."""

        return self.tensors_of(name, self.read(name))

    def layout_of(self, name: str, data: torch.Tensor) -> tuple[int, list[TensorEntry]]:
        """As ``layout``, parsed from the whole file ``data`` already read and checked."""
        from checkpointd.header import header_length, parse_safetensors_header

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
    ) -> Any:
        """The state tree of component ``name``, its tensors read and checked.

        Sharded tensors are assembled whole, except those named in ``templates``
        (tensor name -> a live DTensor): each of those comes back as a DTensor like
        its template, holding only this rank's part, read from the shards it overlaps.
        ``tree``: the component's tree file, already read and checked (else read here).
        ``preloaded[file]``: the tensors of a tensor file the caller already read and
        checked (restore's in-place path), used instead of reading that file.
        """
        from checkpointd.format import decode_tree

        entry = self.manifest.components[name] if entry is None else entry
        tensors = _ComponentTensors(self, entry, templates or {}, preloaded or {})
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

        from checkpointd.format import dtype_by_name
        from checkpointd.shards import intersect

        dtype = dtype_by_name(sharded.dtype, f"{self.where}: tensor {name!r}")
        parts = [
            (shard, part)
            for shard in sharded.shards
            if (part := intersect((tuple(shard.offsets), tuple(shard.shape)), box)) is not None
            and 0 not in part[1]
        ]
        if len(parts) == 1 and parts[0][1] == box:
            return self._shard_part(parts[0][0], dtype, box)  # one shard holds it: no copy
        out = torch.empty(box[1], dtype=dtype)
        for shard, part in parts:
            where = tuple(
                slice(o - b, o - b + n) for o, n, b in zip(part[0], part[1], box[0], strict=True)
            )
            out[where] = self._shard_part(shard, dtype, part)
        return out

    def _shard_part(self, shard: ShardEntry, dtype: torch.dtype, part: Box) -> torch.Tensor:
        """The elements of ``part`` (global coordinates, inside ``shard``) as a strided view
        of the whole blocks of the shard that hold them, after checking those blocks."""
        import torch

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
                f"{self.where}/{shard.file}: the shard at {shard.offsets} has too few block digests"
            )
        begin, end = lo * block, min(hi * block, total)
        if shard.file not in self._sized:
            self._size(shard.file)
            self._sized.add(shard.file)
        data = torch.empty(end - begin, dtype=torch.uint8)
        view = data.numpy().data.cast("B")
        try:
            self.store.read_into(f"{self.folder}/{shard.file}", view, shard.begin + begin)
        except StorageNotFoundError:
            raise self._vanished(shard.file) from None
        if self.verify:
            for index in range(lo, hi):
                at = index * block - begin
                actual = crc32c(view[at : at + block])
                if actual != shard.crc32c[index]:
                    raise CorruptCheckpointError(
                        f"{self.where}/{shard.file}: block {index} of the shard at "
                        f"{shard.offsets} has CRC32C {actual:08x}, the manifest "
                        f"{shard.crc32c[index]:08x}"
                    )
        flat = data.view(dtype)
        offset = flat.storage_offset() + first - begin // size
        return flat.as_strided(part[1], strides, offset)

    def blob_tensor(self, blob: str, code: str, shape: list[int], tensor: str) -> torch.Tensor:
        """Tensor ``tensor`` stored as shared blob ``blob`` (dtype ``code``, ``shape``), after
        the size and (with ``verify``) digest checks: the name is the XXH3-128 of the bytes. A missing blob is damage to this
        checkpoint (CheckpointNotFoundError if the checkpoint itself was deleted meanwhile)."""
        import math

        import torch

        from checkpointd.header import DTYPES_BY_CODE, shape_fits

        entry = self.blobs[blob]
        at = f"{self.store.url.rstrip('/')}/{blob_path(blob)}"
        dtype = DTYPES_BY_CODE.get(code)
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
                raise self._vanished(blob) from None
            raise CorruptCheckpointError(
                f"{at} (used by {self.where}): listed in the manifest but missing"
            ) from None
        if self.verify:
            from checkpointd.digest import blob_name

            actual = blob_name(view)
            if actual != blob:
                raise CorruptCheckpointError(
                    f"{at} (used by {self.where}): its bytes hash to {actual}, not its name"
                )
        return data.view(dtype).view(shape)

    def verify_file(self, entry: FileEntry, progress: Progress | None = None) -> str | None:
        """Stream every byte of one file through CRC32C; what is wrong with it, or None.

        Reads in ``tunables.READ_CHUNK_BYTES`` pieces (constant memory), calling ``progress`` after each.
        """
        return self._verify_path(f"{self.folder}/{entry.path}", entry.size, entry.crc32c, progress)

    def verify_blob(self, entry: BlobEntry, progress: Progress | None = None) -> str | None:
        """As ``verify_file``, for a shared blob the checkpoint uses: its bytes must hash
        (XXH3-128) to its name."""
        return self._verify_path(blob_path(entry.name), entry.size, entry.name, progress)

    def _verify_path(
        self, path: str, expected_size: int, expected: int | str, progress: Progress | None
    ) -> str | None:
        """Size, then CRC32C (``expected`` an int) or blob name (a str) of ``path``."""
        from checkpointd.digest import BlobHasher

        hasher = BlobHasher() if isinstance(expected, str) else None
        try:
            size = self.store.size(path)
            if size != expected_size:
                return f"size {size} does not match the manifest's {expected_size}"
            chunk = tunables.READ_CHUNK_BYTES
            buffer = bytearray(min(chunk, size))
            digest = 0
            for offset in range(0, size, chunk):
                view = memoryview(buffer)[: min(chunk, size - offset)]
                self.store.read_into(path, view, offset)
                if hasher is not None:
                    hasher.update(view)
                else:
                    digest = crc32c(view, digest)
                if progress is not None:
                    progress(len(view))
        except StorageNotFoundError:
            return "listed in the manifest but missing"
        if hasher is not None:
            name = hasher.name()
            return None if name == expected else f"its bytes hash to {name}, not its name"
        if digest != expected:
            return f"CRC32C {digest:08x} does not match the manifest's {expected:08x}"
        return None


def _read_checked(pinned: PinnedFile, data: torch.Tensor) -> int:
    """Fill ``data`` (fresh memory) from ``pinned`` in chunks, each faulted in, read and
    checksummed by one of ``tunables.FILE_READ_THREADS`` threads (all three release the
    GIL); the CRC32C of the whole, combined from the chunks' in order."""
    from checkpointd.hostmem import prefault

    chunk = tunables.READ_CHUNK_BYTES
    view = data.numpy().data.cast("B")
    base = data.data_ptr()

    def work(at: int) -> int:
        part = view[at : at + chunk]
        prefault(base + at, len(part))
        pinned.read_into(part, at)
        return crc32c(part)

    offsets = range(0, len(view), chunk)
    with concurrent.futures.ThreadPoolExecutor(tunables.FILE_READ_THREADS) as pool:
        digests = list(pool.map(work, offsets))
    digest = 0
    for at, part in zip(offsets, digests, strict=True):
        digest = crc32c_combine(digest, part, min(chunk, len(view) - at))
    return digest


class _ComponentTensors(Mapping[str, "torch.Tensor"]):
    """A component's tensors by name, read when the tree decoder asks for them: the
    plain tensor files all at once on first use, sharded tensors one by one."""

    def __init__(
        self,
        reader: StepReader,
        entry: ComponentEntry,
        templates: Mapping[str, Any],
        preloaded: Mapping[str, Mapping[str, torch.Tensor]],
    ):
        self.reader = reader
        self.entry = entry
        self.templates = templates
        self.preloaded = preloaded
        self._plain: dict[str, torch.Tensor] | None = None

    def plain(self) -> dict[str, torch.Tensor]:
        """The tensors of the component's tensor files and shared blobs, read on first use."""
        if self._plain is None:
            plain: dict[str, torch.Tensor] = {}
            for tensor_file in self.entry.tensors:
                done = self.preloaded.get(tensor_file)
                plain.update(self.reader.tensors(tensor_file) if done is None else done)
            for tensor, ref in self.entry.refs.items():
                if tensor in plain:
                    raise CorruptCheckpointError(
                        f"{self.reader.where}: tensor {tensor!r} is both in a file and a blob"
                    )
                plain[tensor] = self.reader.blob_tensor(ref.blob, ref.dtype, ref.shape, tensor)
            self._plain = plain
        return self._plain

    def __getitem__(self, name: str) -> torch.Tensor:
        from checkpointd.shards import as_template

        sharded = self.entry.sharded.get(name)
        template = self.templates.get(name)
        if template is None:
            if sharded is None:
                return self.plain()[name]
            return self.reader.region(
                name, sharded, ((0,) * len(sharded.shape), tuple(sharded.shape))
            )
        plain = None if sharded is not None else self.plain()[name]
        placed: torch.Tensor = as_template(name, template, plain, sharded, self.reader.region)
        return placed

    def __contains__(self, name: object) -> bool:
        return name in self.entry.sharded or name in self.plain()

    def __iter__(self) -> Iterator[str]:
        return iter({**self.plain(), **self.entry.sharded})

    def __len__(self) -> int:
        return len({**self.plain(), **self.entry.sharded})


def verify_step(
    store: Store,
    step: int,
    manifest: Manifest,
    progress: Progress | None = None,
    *,
    seen: dict[tuple[str, int], str | None] | None = None,
) -> list[str]:
    """Check every file and shared blob of a committed step (sizes, CRC32C of files,
    XXH3-128 of blobs against their names); one line per bad file or blob.

    ``seen`` caches blob results across calls (a blob shared by many checkpoints is
    read once); a bad blob is reported again for every checkpoint that uses it.
    """
    reader = StepReader(store, step, manifest)
    bad: list[str] = []
    for entry in manifest.files:
        problem = reader.verify_file(entry, progress)
        if problem is not None:
            bad.append(f"{reader.where}/{entry.path}: {problem}")
    for blob in manifest.blobs:
        key = (blob.name, blob.size)
        if seen is not None and key in seen:
            problem = seen[key]
        else:
            problem = reader.verify_blob(blob, progress)
            if seen is not None:
                seen[key] = problem
        if problem is not None:
            bad.append(f"{store.url.rstrip('/')}/{blob_path(blob.name)} (shared): {problem}")
    return bad
