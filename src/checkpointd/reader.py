"""Reading the files of one committed step: the one reader of the on-storage format.

``StepReader`` checks a file's size against the manifest before parsing a byte
of it, and (with ``verify``) its CRC32C; it reads tensor headers alone (inspect),
whole tensor files (load, restore, export) and component trees; ``verify_file``
streams a file through CRC32C with a progress callback (verify). Torch is
imported only by the methods that build tensors, so verifying a root does not
load it. Blocking; any thread (one StepReader may serve several threads).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from checkpointd import catalog, tunables
from checkpointd.checksum import crc32c
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
    step_dirname,
)
from checkpointd.storage import Store

if TYPE_CHECKING:
    import torch

    from checkpointd.header import TensorEntry

__all__ = ["StepReader", "verify_step"]
"""Bytes per read when a file is streamed through CRC32C (verify)."""

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

        path = f"{self.folder}/{name}"
        size = self._size(name)
        try:
            # Read, never mapped, even where the store could (capabilities.memory_map): a
            # tensor over a map pins a deleted checkpoint's disk space for as long as an
            # object keeps it (an optimizer keeps its state), and on NFS it can SIGBUS;
            # reading measured no slower on a 600 MB checkpoint.
            data = torch.empty(size, dtype=torch.uint8)
            view = data.numpy().data.cast("B")
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
        from checkpointd.header import header_length, parse_safetensors_header

        path, at = f"{self.folder}/{name}", f"{self.where}/{name}"
        size = self._size(name)
        try:
            length = header_length(self.store.read_bytes(path, 0, 8), size, where=at)
            header = self.store.read_bytes(path, 8, length)
        except StorageNotFoundError:
            raise self._vanished(name) from None
        return parse_safetensors_header(header, size - 8 - length, where=at)

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """Every tensor of a tensor file, as views of one buffer read in a single pass."""
        from checkpointd.header import header_length, parse_safetensors_header

        data = self.read(name)
        where = f"{self.where}/{name}"
        length = header_length(bytes(data[:8].numpy()), data.numel(), where=where)
        start = 8 + length
        entries = parse_safetensors_header(
            bytes(data[8:start].numpy()), data.numel() - start, where=where
        )
        tensors: dict[str, torch.Tensor] = {}
        for entry in entries:
            chunk = data[start + entry.begin : start + entry.end]
            if (start + entry.begin) % entry.dtype.itemsize:
                chunk = chunk.clone()  # misaligned for this dtype: copy to an aligned buffer
            tensors[entry.name] = chunk.view(entry.dtype).view(entry.shape)
        return tensors

    def component(self, name: str, entry: ComponentEntry | None = None) -> Any:
        """The state tree of component ``name``, its tensors read and checked."""
        from checkpointd.format import decode_tree

        entry = self.manifest.components[name] if entry is None else entry
        tensors: dict[str, torch.Tensor] = {}
        for tensor_file in entry.tensors:
            tensors.update(self.tensors(tensor_file))
        for tensor, ref in entry.refs.items():
            if tensor in tensors:
                raise CorruptCheckpointError(
                    f"{self.where}: tensor {tensor!r} of {name!r} is both in a file and a blob"
                )
            tensors[tensor] = self.blob_tensor(ref.blob, ref.dtype, ref.shape, tensor)
        tree = bytes(self.read(entry.tree).numpy())
        return decode_tree(tree, tensors, where=f"{self.where}/{entry.tree}")

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
