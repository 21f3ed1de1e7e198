"""The service's messages: msgspec structs in one tagged union, in length-prefixed frames.

A frame is a 4-byte big-endian length then that many bytes of msgpack encoding
one ``Message``; a length over ``tunables.MAX_FRAME_BYTES`` is refused before anything is
read or allocated (frames.py reads and sends them). Never pickle: decoding only builds these structs. Requests
carry an ``id`` the reply repeats; ``Committed``/``Failed``/``Notice`` arrive
unasked. File descriptors (shared-memory segments) travel beside a frame
(``Segment``, ``Held``).
No torch here (``checkpointd status`` must not import it).
"""

from __future__ import annotations

import struct
from datetime import datetime
from typing import Any

import msgspec

from checkpointd import tunables
from checkpointd.errors import ServiceError
from checkpointd.format.layout import SaveLayout
from checkpointd.format.manifest import CheckpointInfo, SpecEntry
from checkpointd.ranks.hosted import HostedGroup

__all__ = [
    "PREFIX",
    "Accepted",
    "Alloc",
    "Committed",
    "ComponentDesc",
    "EntryDesc",
    "Error",
    "Failed",
    "Free",
    "Held",
    "HeldFile",
    "JoinPeers",
    "Lookup",
    "Message",
    "NotHeld",
    "Notice",
    "Ok",
    "OpenWriter",
    "PeerService",
    "ProtocolError",
    "Segment",
    "ShardDesc",
    "SnapshotDesc",
    "Status",
    "StatusReply",
    "Submit",
    "WriterOpened",
    "decode",
    "encode",
]

PREFIX = struct.Struct(">I")
"""A frame's length prefix: 4 bytes, big-endian."""


class ProtocolError(ServiceError):
    """A frame that is not a message of this protocol (garbage, too large, cut short,
    an unknown kind)."""


class _Msg(msgspec.Struct, tag=True, tag_field="kind", forbid_unknown_fields=True):
    pass


# -- requests (client -> service) ---------------------------------------------------


class OpenWriter(_Msg):
    """Start a writer in the service: its target (root, storage options, layout: the
    trainer's ``SaveTarget``, sent once) and its retention and write options."""

    id: int
    root: str
    storage_options: dict[str, Any] | None = None
    layout: SaveLayout | None = None
    """The tunables that decide every save's files, the trainer's when it made the writer
    (shard block, direct I/O, shard index and incremental thresholds); None: the
    service's own, read when the writer opens."""
    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"
    max_pending: int = 1
    max_concurrency: int = 8
    newer_steps: str = "error"
    incremental: bool = False
    chunk_bytes: int | None = None
    """Bytes per write call (the writer's ``chunk_bytes``); None: the service's default."""
    group: HostedGroup | None = None
    """A many-rank writer's group (ranks/hosted.py); None: the writer saves alone."""


class Alloc(_Msg):
    """A shared-memory segment of ``nbytes`` to capture into (waits while memory is full)."""

    id: int
    nbytes: int


class Free(_Msg):
    """Give back a segment that will not be submitted (its capture failed)."""

    id: int
    segment: int


class EntryDesc(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One tensor of a component's data region (``header.TensorEntry``)."""

    name: str
    dtype: str  # the safetensors dtype code
    shape: list[int]
    begin: int
    end: int


class ShardDesc(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One DTensor of a component (``storable.CapturedShard``): its global shape, where
    this rank's shard sits in it, and whether this rank writes it."""

    name: str
    dtype: str  # the safetensors dtype code
    shape: list[int]
    offsets: list[int]
    local_shape: list[int]
    written: bool


class ComponentDesc(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One captured component: its encoded tree and where its tensors are in the segment;
    its DTensors and the region of the shards this rank writes (``shard_entries``)."""

    name: str
    tree: bytes
    entries: list[EntryDesc]
    offset: int
    nbytes: int
    shards: list[ShardDesc] = msgspec.field(default_factory=list)
    shard_entries: list[EntryDesc] = msgspec.field(default_factory=list)
    shard_offset: int = 0
    shard_nbytes: int = 0
    crcs: list[int | None] = msgspec.field(default_factory=list)
    """The CRC32C of each of ``entries``' bytes, taken as capture copied them (None where
    it did not; empty: none), which the service's writer uses as its own."""


class SnapshotDesc(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything ``plan.Snapshot`` holds but the staging buffer (the segment) and the
    layout (its writer's, ``OpenWriter.layout``)."""

    step: int
    created_at: datetime
    components: list[ComponentDesc]
    metrics: dict[str, Any]
    metadata: dict[str, Any]
    specs: dict[str, SpecEntry] = msgspec.field(default_factory=dict)
    per_rank: dict[str, str] = msgspec.field(default_factory=dict)
    attempt: int = 0
    rank: int = 0


class Submit(_Msg):
    """Write ``snapshot`` (captured into ``segment``) for ``writer``: the service owns it now."""

    id: int
    writer: int
    segment: int
    snapshot: SnapshotDesc


class Lookup(_Msg):
    """Does the service hold ``step`` of ``root`` in memory? ``rank``: the asking
    process's rank in the group that restores (where several local ranks of a many-rank
    save are held, that rank's copy is lent first). ``exact``: only saved rank ``rank``'s
    share (or a single process's save), never another rank's in its place."""

    id: int
    root: str
    storage_options: dict[str, Any] | None
    step: int
    rank: int = 0
    exact: bool = False


class Status(_Msg):
    id: int


class PeerService(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One service of a job (a node): its identity (``StatusReply.service``), its peer
    address (HOST:PORT) and the job's ranks it serves."""

    service: str
    address: str
    ranks: list[int]


class JoinPeers(_Msg):
    """A job's trainer on this node tells its service the job's key and services (rank
    order) for ``root``: with ``replicas`` > 0, the shares of ``ranks`` (this node's) that
    it holds are sent to that many other services; either way the service may fetch from
    them, and they from it, the shares of that root (wire/peers.py)."""

    id: int
    root: str
    storage_options: dict[str, Any] | None
    job: str
    key: bytes
    ranks: list[int]
    replicas: int
    services: list[PeerService]


# -- replies and events (service -> client) -----------------------------------------


class WriterOpened(_Msg):
    id: int
    writer: int


class Segment(_Msg):
    """A segment (its fd beside the frame) of ``size`` bytes, to map read-write."""

    id: int
    segment: int
    size: int


class Ok(_Msg):
    id: int


class Accepted(_Msg):
    """The service owns the save now: it commits even if the client dies."""

    id: int
    save: int


class HeldFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A file of a held checkpoint: its ``head`` bytes, then ``length`` bytes of the
    segment from ``offset``; ``crc32c`` of those bytes, as committed (a client serves the
    file only where storage's manifest lists this path, size and CRC32C)."""

    path: str
    head: bytes
    offset: int
    length: int
    crc32c: int


class Held(_Msg):
    """The held checkpoint (its segment's read-only fd beside the frame): its files,
    each with the CRC32C it was committed with."""

    id: int
    step: int
    files: list[HeldFile]
    size: int
    source: str = "memory"
    """"peer": the copy is a replica another node's service sent (wire/peers.py)."""
    rank: int | None = None
    """The saved rank whose share this is; None: a single process's save (every file)."""


class NotHeld(_Msg):
    id: int


class StatusReply(_Msg):
    id: int
    pid: int
    saves_in_flight: int
    bytes_staged: int
    bytes_kept: int
    memory_limit: int | None
    kept: dict[str, list[int]]
    clients: int
    committed: int
    failed: int
    refused: dict[str, int] = msgspec.field(default_factory=dict)
    """What the service refused since it started, by kind: ``connections`` (past a cap),
    ``descriptors`` (none left to accept one), ``segments`` (past a client's cap),
    ``frames`` (a frame too large, too deep, too slow or malformed), ``peers`` (a peer
    connection that did not prove its job's key)."""
    service: str = ""
    """This service's identity (random, made at start)."""
    peer_address: str | None = None
    """HOST:PORT other services reach it at; None: no peer port."""
    replicas_held: int = 0
    """Shares of other nodes' ranks held (replicas)."""
    replicas_sent: int = 0
    replica_bytes_sent: int = 0
    replicas_pending: int = 0
    """Replicas to send not yet over: waiting for this node's saves in flight, or under way."""
    replicas_superseded: int = 0
    """Replicas never sent because a newer step of the same rank was held before they
    started (only the newest matters to a restore)."""
    replica_failures: dict[str, int] = msgspec.field(default_factory=dict)
    """Replicas not sent, not held or not fetched, by why."""


class Committed(_Msg):
    save: int
    info: CheckpointInfo


class Failed(_Msg):
    """A save failed: ``error`` names a checkpointd error class, ``message`` says why."""

    save: int
    error: str
    message: str


class Notice(_Msg):
    """A background error after a commit (retention), to raise at the next save or wait."""

    writer: int
    error: str
    message: str


class Error(_Msg):
    """A request (``id``; 0 if unknown) was refused; after a protocol error the service
    closes the connection."""

    id: int
    error: str
    message: str


Message = (
    OpenWriter
    | Alloc
    | Free
    | Submit
    | Lookup
    | Status
    | JoinPeers
    | WriterOpened
    | Segment
    | Ok
    | Accepted
    | Held
    | NotHeld
    | StatusReply
    | Committed
    | Failed
    | Notice
    | Error
)

_ENCODER = msgspec.msgpack.Encoder()
_DECODER: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    """The frame of ``message``: length prefix and msgpack body."""
    body = _ENCODER.encode(message)
    limit = tunables.MAX_FRAME_BYTES
    if len(body) > limit:
        raise ProtocolError(
            f"a {type(message).__name__} message encodes to {len(body)} bytes, over the "
            f"service's {limit}-byte limit (the state's non-tensor part is too large)"
        )
    return PREFIX.pack(len(body)) + body


def decode(body: bytes | memoryview) -> Message:
    """The message in a frame's body; ProtocolError if it is not one."""
    try:
        return _DECODER.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"not a message of the checkpointd service protocol: {exc}") from None
    except RecursionError:  # the service bounds depth first (bounds.py); a client may not
        raise ProtocolError("a message nested too deeply to decode") from None
