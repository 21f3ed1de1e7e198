"""The manifest: a checkpoint's commit marker and table of contents.

The manifest is JSON encoded from versioned msgspec Structs and ends with its
own CRC32C (``"manifest_crc32c"``, the last member), so a flipped bit anywhere
in it is caught before a field is trusted. docs/format.md is the spec.

Schema evolution rules: new optional fields with defaults may be added without
a version bump (older readers ignore them); anything an older reader would
misread bumps ``SCHEMA_VERSION``; readers refuse newer versions. Every older
version so far decodes as it is (each added only fields with defaults); a
version that changes a field's meaning needs a migration here, with a test.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar

import msgspec

from checkpointd import tunables
from checkpointd.errors import (
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    UnsupportedValueError,
)
from checkpointd.format.checksum import crc32c
from checkpointd.format.layout import MANIFEST_NAME, step_dirname
from checkpointd.format.manifest_checks import check_consistency, shard_problem

__all__ = [
    "MANIFEST_NAME",
    "SCHEMA_VERSION",
    "BlobEntry",
    "BlobRef",
    "CheckpointInfo",
    "ComponentEntry",
    "FileEntry",
    "Manifest",
    "ShardEntry",
    "ShardedTensor",
    "SpecEntry",
    "decode_manifest",
    "encode_manifest",
    "schema_for",
    "shard_problem",
    "step_dirname",
    "too_deep",
]

SCHEMA_VERSION = 4
"""The newest schema this version reads. A checkpoint is written with the oldest schema
that describes it: 4 only if its shard entries are in shard index files
(``Manifest.shard_indexes``), which an older reader would take for missing shards; 3 if a shard is stored as a shared blob (``ShardEntry.blob``),
which a version-2 reader would look for in the step folder; 2 if a component holds
sharded tensors (``ComponentEntry.sharded``) or references shared blobs
(``Manifest.blobs``), which a version-1 reader would misread; 1 otherwise."""
FORMAT_NAME = "checkpointd"

_T = TypeVar("_T")
_TAIL = re.compile(rb',"manifest_crc32c":"([0-9a-f]{8})"}\n?\Z')


class FileEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """One file of a checkpoint, relative to its step folder."""

    path: str
    size: int
    crc32c: int
    rank: int = 0


class ShardEntry(msgspec.Struct, frozen=True, omit_defaults=True):
    """One stored shard of a sharded tensor: the box ``offsets .. offsets + shape`` of the
    global tensor, row-major at byte ``begin`` of tensor file ``file`` (key: the tensor's
    name), or, if ``blob`` is set (schema 3, incremental saves), the whole of shared blob
    ``blob`` (``file`` empty, ``begin`` 0). ``crc32c`` holds the CRC32C of each
    ``block_bytes`` piece of the shard's bytes (the last one shorter), so a reader of part
    of a shard checks what it read."""

    file: str
    offsets: list[int]
    shape: list[int]
    begin: int
    block_bytes: int
    crc32c: list[int]
    blob: str = ""


class ShardedTensor(msgspec.Struct, frozen=True):
    """A tensor stored as shards (a DTensor): dtype name, global shape, and shards that
    tile it exactly, each written once."""

    dtype: str
    shape: list[int]
    shards: list[ShardEntry]


class BlobRef(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """A tensor stored as a shared blob (incremental saves): its blob, dtype code and shape."""

    blob: str
    dtype: str
    shape: list[int]


class BlobEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """One shared blob a checkpoint uses (``blobs/NAME`` under the root).

    No CRC32C: the name is the XXH3-128 digest of the bytes, which readers check.
    ``written``: this save wrote it; False when it references bytes an earlier save stored.
    """

    name: str
    size: int
    written: bool = False


class ComponentEntry(msgspec.Struct, frozen=True):
    """Where one component lives: its tree file, its tensor files, its sharded tensors
    (many ranks; each shard's file is listed in ``Manifest.files`` too) and the tensors
    stored as shared blobs (incremental saves). The last two are schema 2."""

    tree: str
    tensors: list[str] = msgspec.field(default_factory=list)
    nbytes: int = 0
    num_tensors: int = 0
    sharded: dict[str, ShardedTensor] = msgspec.field(default_factory=dict)
    refs: dict[str, BlobRef] = msgspec.field(default_factory=dict)


class SpecEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """How ``checkpointd.build`` makes one component again (see spec.py, docs/format.md).

    ``module``/``qualname`` name the callable, ``kind`` is ``model``, ``optimizer``,
    ``scheduler`` or ``object``; ``of`` the component it is built over (an
    optimizer's model, a scheduler's optimizer); ``params`` an optimizer's
    parameter names in the associated model, one list per param group.
    """

    module: str
    qualname: str
    kind: str
    args: list[Any] = msgspec.field(default_factory=list)
    kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    of: str | None = None
    params: list[list[str]] | None = None


class Manifest(msgspec.Struct, frozen=True):
    """The manifest, schema versions 1 to 4 (2 adds sharded tensors, per-rank
    components' layout and shared blobs, 3 shards stored as blobs, 4 shard entries in
    index files; see ``schema_for``)."""

    schema_version: int
    step: int
    created_at: datetime
    library_version: str
    components: dict[str, ComponentEntry]
    files: list[FileEntry]
    metrics: dict[str, Any] = msgspec.field(default_factory=dict)
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    world_size: int = 1
    format: str = FORMAT_NAME
    writer: str = ""
    """Random id of the writer instance that committed it ("" if unknown); see retention."""
    lineage: str = ""
    """The line of writer instances it continues ("": its ``writer``); see lineage.py."""
    specs: dict[str, SpecEntry] = msgspec.field(default_factory=dict)
    """Optional: how to rebuild components (``save(specs=...)``); absent in older checkpoints."""
    per_rank: dict[str, list[str]] = msgspec.field(default_factory=dict)
    """A per-rank component's name -> the components holding each rank's state, by rank
    (``NAME-rankR``); those are ordinary components to a reader that ignores this field."""

    blobs: list[BlobEntry] = msgspec.field(default_factory=list)
    """Shared blobs the checkpoint uses (schema 2, incremental saves); see docs/format.md."""
    shard_indexes: list[str] = msgspec.field(default_factory=list)
    """Schema 4: the shard index files (each listed in ``files``, by rank) holding shard
    entries of the sharded tensors besides those listed inline (format/shard_index.py)."""

    @property
    def nbytes(self) -> int:
        """Total size of the files and blobs it uses (the manifest itself excluded)."""
        return sum(f.size for f in self.files) + sum(b.size for b in self.blobs)

    @property
    def referenced_nbytes(self) -> int:
        """Bytes of the blobs it uses that an earlier save wrote (not written by this save)."""
        return sum(b.size for b in self.blobs if not b.written)


class _Version(msgspec.Struct):
    schema_version: int
    format: str = FORMAT_NAME


def schema_for(
    components: Mapping[str, ComponentEntry], blobs: Sequence[Any] = (), indexed: bool = False
) -> int:
    """The schema version a manifest with these components and shared blobs (and, if
    ``indexed``, shard index files) is written with."""
    if indexed:
        return 4
    entries = components.values()
    if any(shard.blob for e in entries for t in e.sharded.values() for shard in t.shards):
        return 3
    if blobs or any(entry.sharded or entry.refs for entry in entries):
        return 2
    return 1


def too_deep(value: Any) -> bool:
    """True if containers nest more than tunables.MAX_JSON_DEPTH levels in ``value``.

    Iterative, so safe on any depth; for checking metrics/metadata at save().
    """
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth > tunables.MAX_JSON_DEPTH:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _deep_field(manifest: Manifest) -> str | None:
    """The name of the first free-form field nested deeper than tunables.MAX_JSON_DEPTH, if any."""
    if any(too_deep([s.args, s.kwargs]) for s in manifest.specs.values()):
        return "specs"
    return next((f for f in ("metrics", "metadata") if too_deep(getattr(manifest, f))), None)


def encode_manifest(manifest: Manifest) -> bytes:
    """Encode ``manifest`` as JSON with its trailing CRC32C member.

    Raises UnsupportedValueError for metrics or metadata nested deeper than
    tunables.MAX_JSON_DEPTH, or a manifest over tunables.MAX_MANIFEST_BYTES, which no
    reader would accept.
    """
    if (field := _deep_field(manifest)) is not None:
        raise UnsupportedValueError(
            f"{field} is nested deeper than {tunables.MAX_JSON_DEPTH} levels; flatten it to save"
        )
    body = msgspec.json.encode(manifest)
    data = body[:-1] + b',"manifest_crc32c":"%08x"}\n' % crc32c(body)
    if len(data) > tunables.MAX_MANIFEST_BYTES:
        raise UnsupportedValueError(
            f"the manifest of step {manifest.step} would be {len(data):,} bytes, over the "
            f"{tunables.MAX_MANIFEST_BYTES:,} any reader accepts (tunables.MAX_MANIFEST_BYTES); "
            "save fewer shards (HSDP: shard over fewer ranks) or fewer tensors"
        )
    return data


def decode_manifest(data: bytes, *, where: str = "manifest") -> Manifest:
    """Check the digest, the schema version and the fields, then return the manifest.

    Raises CorruptCheckpointError for damage (anything the decoder refuses,
    JSON nested too deep included) and IncompatibleCheckpointError for a newer
    schema. Never evaluates anything from the payload.
    """
    if len(data) > tunables.MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{where}: {len(data)} bytes is too large for a manifest")
    match = _TAIL.search(data)
    if match is None:
        raise CorruptCheckpointError(f"{where}: missing or malformed manifest_crc32c trailer")
    body = data[: match.start()] + b"}"
    expected = int(match.group(1), 16)
    actual = crc32c(body)
    if actual != expected:
        raise CorruptCheckpointError(
            f"{where}: manifest digest mismatch (stored {expected:08x}, computed {actual:08x})"
        )
    version = _decode(where, lambda: msgspec.json.decode(body, type=_Version))
    if version.format != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: format {version.format!r} is not {FORMAT_NAME!r}")
    if version.schema_version > SCHEMA_VERSION:
        raise IncompatibleCheckpointError(
            f"{where}: schema_version {version.schema_version} is newer than this checkpointd "
            f"reads ({SCHEMA_VERSION}); upgrade checkpointd to load it"
        )
    if version.schema_version < 1:
        raise CorruptCheckpointError(f"{where}: invalid schema_version {version.schema_version}")
    # Versions 1 to 4 decode as they are (2 to 4 only added fields with defaults).
    manifest = _decode(where, lambda: msgspec.json.decode(body, type=Manifest))
    if (field := _deep_field(manifest)) is not None:
        raise CorruptCheckpointError(
            f"{where}: {field} is nested deeper than {tunables.MAX_JSON_DEPTH}"
        )
    check_consistency(manifest, where)
    return manifest


def _decode(where: str, decode: Callable[[], _T]) -> _T:
    """Run ``decode`` on the untrusted payload; whatever it raises is damage.

    That covers a wrong type, a missing key in a migration, and the
    RecursionError msgspec raises on JSON nested about 1,000 deep.
    """
    try:
        return decode()
    except RecursionError:
        raise CorruptCheckpointError(f"{where}: JSON nested too deep to decode") from None
    except msgspec.ValidationError as exc:
        raise CorruptCheckpointError(f"{where}: invalid manifest ({exc})") from exc
    except Exception as exc:
        raise CorruptCheckpointError(f"{where}: not a checkpointd manifest ({exc})") from exc


class CheckpointInfo(msgspec.Struct, frozen=True):
    """What a committed checkpoint is: returned by saves, listings and loads.

    Attributes:
        step: The training step it was saved as.
        path: Where it is: the root's step folder (a local path or URL).
        created_at: When ``save()`` was called (UTC).
        nbytes: The bytes of its files and the blobs it uses.
        metrics: The metrics saved with it.
        metadata: The metadata saved with it.
        components: The names of its components.
        referenced_nbytes: Of ``nbytes``, the bytes of shared blobs an earlier save wrote.
    """

    step: int
    path: str
    created_at: datetime
    nbytes: int
    metrics: dict[str, Any]
    metadata: dict[str, Any]
    components: tuple[str, ...]
    referenced_nbytes: int = 0
    """Of ``nbytes``, the bytes of shared blobs an earlier save wrote (incremental saves)."""

    @property
    def written_nbytes(self) -> int:
        """Bytes this checkpoint's save wrote: ``nbytes`` less what it references."""
        return self.nbytes - self.referenced_nbytes

    @classmethod
    def from_manifest(cls, manifest: Manifest, path: str) -> CheckpointInfo:
        """Describe the checkpoint committed by ``manifest`` in folder ``path``."""
        return cls(
            step=manifest.step,
            path=path,
            created_at=manifest.created_at,
            nbytes=manifest.nbytes,
            metrics=manifest.metrics,
            metadata=manifest.metadata,
            components=tuple(manifest.components),
            referenced_nbytes=manifest.referenced_nbytes,
        )
