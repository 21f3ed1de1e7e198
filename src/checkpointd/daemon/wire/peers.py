"""What two services speak on the peer port (TCP): the handshake that proves a job's
key, and the replica messages. No torch here.

A peer connection is framed as the local socket is (frames.py: a 4-byte length, a
msgpack body, the same bounds), but decodes only these kinds: a request of the local
protocol (``OpenWriter``, ``Lookup``...) is not a message here. The key never
travels: the connecting side names its job (a public id) and a nonce, the accepting
side answers with its own nonce and its proof, the connecting side checks it and
sends its own proof; each proof is an HMAC-SHA256 of both nonces under the job's key,
with the side's role in it (a proof cannot be reflected back), compared with
``hmac.compare_digest``. Before the accepting side has checked the proof, it answers
nothing but its ``Challenge``. After it, ``PushReplica`` or ``FetchReplica``; a
``Replica``'s bytes follow its frame raw on the stream (``size`` of them).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import msgspec

from checkpointd.daemon.wire.protocol import HeldFile, ProtocolError

__all__ = [
    "NONCE_BYTES",
    "Challenge",
    "FetchReplica",
    "Hello",
    "PeerDone",
    "PeerMessage",
    "Proof",
    "PushReplica",
    "ReplicaRef",
    "decode_peer",
    "encode_peer",
    "new_nonce",
    "options_digest",
    "proof",
    "proven",
]

NONCE_BYTES = 32


class _Peer(msgspec.Struct, tag=True, tag_field="kind", forbid_unknown_fields=True):
    pass


class Hello(_Peer):
    """The connecting side: its job's public id and its nonce."""

    job: str
    nonce: bytes


class Challenge(_Peer):
    """The accepting side: its nonce and its proof of the key (``proof(key, "accept")``)."""

    nonce: bytes
    proof: bytes


class Proof(_Peer):
    """The connecting side's proof of the key (``proof(key, "connect")``)."""

    proof: bytes


class ReplicaRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Which share: a root (its resolved name and the SHA-256 of its storage options'
    sorted JSON: the options themselves, credentials, never travel), a step, the saving
    rank."""

    root: str
    options: str
    step: int
    rank: int


class PushReplica(_Peer):
    """Hold this share (its files as the saving service holds them): ``size`` raw bytes
    of its segment follow this frame."""

    ref: ReplicaRef
    files: list[HeldFile]
    size: int


class FetchReplica(_Peer):
    """Send the share ``ref`` names if held (a ``PushReplica`` back, its bytes after it),
    else ``PeerDone(False, ...)``."""

    ref: ReplicaRef


class PeerDone(_Peer):
    """The end of a request: held (``ok``), or not and why."""

    ok: bool
    why: str = ""


PeerMessage = Hello | Challenge | Proof | PushReplica | FetchReplica | PeerDone

_ENCODER = msgspec.msgpack.Encoder()
_DECODER: msgspec.msgpack.Decoder[PeerMessage] = msgspec.msgpack.Decoder(PeerMessage)


def encode_peer(message: PeerMessage) -> bytes:
    """The frame of ``message`` (length prefix and msgpack body)."""
    from checkpointd.daemon.wire.protocol import PREFIX

    body = _ENCODER.encode(message)
    return PREFIX.pack(len(body)) + body


def decode_peer(body: bytes | memoryview) -> PeerMessage:
    """The peer message in a frame's body; ProtocolError if it is not one."""
    try:
        return _DECODER.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"not a message of the checkpointd peer protocol: {exc}") from None
    except RecursionError:
        raise ProtocolError("a message nested too deeply to decode") from None


def new_nonce() -> bytes:
    """A fresh random nonce."""
    return secrets.token_bytes(NONCE_BYTES)


def proof(key: bytes, role: str, connecting: bytes, accepting: bytes) -> bytes:
    """HMAC-SHA256 under ``key`` of the side's ``role`` ("connect" or "accept") and both
    nonces."""
    return hmac.new(
        key, b"checkpointd-peer/" + role.encode() + connecting + accepting, "sha256"
    ).digest()


def proven(key: bytes, role: str, connecting: bytes, accepting: bytes, claimed: bytes) -> bool:
    """True if ``claimed`` is ``role``'s proof of ``key`` for these nonces (constant time)."""
    return hmac.compare_digest(proof(key, role, connecting, accepting), claimed)


def options_digest(options_json: str) -> str:
    """How a root's storage options are named between services: SHA-256 of their sorted
    JSON (``memtier.RootKey.options``)."""
    return hashlib.sha256(options_json.encode()).hexdigest()
