"""Hostile connections on a real service's peer port (real TCP on 127.0.0.1): garbage,
an unknown job, a wrong proof of the key, an oversized or deeply nested frame, a sender
that stalls inside its handshake. Each gets nothing (at most the ``Challenge`` a known
job's name earns) and is closed; the service counts them and keeps serving: a peer that
proves the key is answered, and local clients still get their status.
"""

from __future__ import annotations

import socket
import struct
import time

import pytest

from checkpointd import tunables
from checkpointd.daemon.client.client import status
from checkpointd.daemon.wire import peers as w
from tests.support.service import join_peer_job, running_service

KEY = bytes(range(32))
JOB = "hostile-test-job"


def _open(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.settimeout(tunables.PEER_HANDSHAKE_SECONDS + 10)
    return sock


def _everything(sock: socket.socket) -> bytes:
    """What the service sends until it closes the connection."""
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    sock.close()
    return got


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _messages(data: bytes) -> list[w.PeerMessage]:
    found = []
    while data:
        (length,) = struct.unpack(">I", data[:4])
        found.append(w.decode_peer(data[4 : 4 + length]))
        data = data[4 + length :]
    return found


def _proven(address: str, key: bytes) -> socket.socket:
    """A connection that proved ``key`` (AssertionError if the service did not prove it
    back)."""
    sock = _open(address)
    mine = w.new_nonce()
    sock.sendall(w.encode_peer(w.Hello(JOB, mine)))
    (length,) = struct.unpack(">I", sock.recv(4, socket.MSG_WAITALL))
    challenge = w.decode_peer(sock.recv(length, socket.MSG_WAITALL))
    assert isinstance(challenge, w.Challenge)
    assert w.proven(key, "accept", mine, challenge.nonce, challenge.proof)
    sock.sendall(w.encode_peer(w.Proof(w.proof(key, "connect", mine, challenge.nonce))))
    return sock


@pytest.mark.timeout(120)
def test_hostile_peer_connections_get_nothing_and_the_service_goes_on() -> None:
    with running_service("--peer-address", "127.0.0.1") as service:
        address = join_peer_job(service.socket, root="/tmp/peers-hostile-root", job=JOB, key=KEY)
        stalled = _open(address)  # a length prefix cut short, then nothing
        stalled.sendall(b"\x00\x00")
        started = time.monotonic()

        garbage = _open(address)
        garbage.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _everything(garbage) == b""

        unknown = _open(address)
        unknown.sendall(w.encode_peer(w.Hello("some-other-job", w.new_nonce())))
        assert _everything(unknown) == b""

        wrong = _open(address)
        nonce = w.new_nonce()
        wrong.sendall(w.encode_peer(w.Hello(JOB, nonce)))
        wrong.sendall(w.encode_peer(w.Proof(b"\x00" * 32)))
        fetch = w.FetchReplica(w.ReplicaRef("/tmp/peers-hostile-root", "x", 1, 0))
        wrong.sendall(w.encode_peer(fetch))
        answered = _messages(_everything(wrong))
        assert [type(m) for m in answered] == [w.Challenge]  # no answer to the fetch

        oversized = _open(address)
        oversized.sendall(struct.pack(">I", 1 << 20) + b"\x90" * 1000)
        assert _everything(oversized) == b""

        nested = _open(address)
        nested.sendall(_frame(b"\x91" * 500 + b"\xc0"))  # 500 arrays deep
        assert _everything(nested) == b""

        # a side that does not know the key cannot tell the service's proof from noise
        other = _open(address)
        mine = w.new_nonce()
        other.sendall(w.encode_peer(w.Hello(JOB, mine)))
        other.sendall(w.encode_peer(w.Proof(w.proof(bytes(32), "connect", mine, mine))))
        (challenge,) = _messages(_everything(other))
        assert isinstance(challenge, w.Challenge)
        assert not w.proven(bytes(32), "accept", mine, challenge.nonce, challenge.proof)
        assert w.proven(KEY, "accept", mine, challenge.nonce, challenge.proof)

        # a peer that proves the key is served
        peer = _proven(address, KEY)
        peer.sendall(w.encode_peer(fetch))
        (length,) = struct.unpack(">I", peer.recv(4, socket.MSG_WAITALL))
        reply = w.decode_peer(peer.recv(length, socket.MSG_WAITALL))
        assert reply == w.PeerDone(False, "not held")
        peer.close()

        assert _everything(stalled) == b""  # cut off once the handshake's time ran out
        assert time.monotonic() - started >= tunables.PEER_HANDSHAKE_SECONDS - 1
        reply = status(service.socket)
        assert reply.refused.get("peers", 0) >= 4  # unknown, wrong proof, wrong key, stalled
        assert reply.refused.get("frames", 0) >= 3  # garbage, oversized, nested
        assert reply.clients == 0
