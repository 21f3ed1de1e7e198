"""A real service fetching a share it lacks from its job's peers, when the peers fail:
one whose port is refused, one that dies in the middle of the share's bytes, one that
sends a share of another step. Peers here are test threads on real TCP that speak the
peer protocol with the job's key; the service must end each attempt cleanly (nothing
held from a broken transfer, the failure counted), try the next peer, and lend the
share only once one sent it whole.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from collections.abc import Iterator

import pytest

from checkpointd.daemon.client.client import connect, status
from checkpointd.daemon.wire import peers as w
from checkpointd.daemon.wire import protocol as p
from checkpointd.format.checksum import crc32c
from tests.support.service import running_service

KEY = os.urandom(32)
JOB = "fetch-faults-job"
ROOT = "/tmp/peers-fetch-root"
SHARE = bytes(range(256)) * 64  # 16 KiB: the share's bytes
# the CRC32C of the whole file, its head then its bytes in the share (HeldFile's)
FILES = [
    p.HeldFile("000000000001/a.safetensors", b"head", 0, len(SHARE), crc32c(SHARE, crc32c(b"head")))
]


def _read(sock: socket.socket) -> w.PeerMessage:
    (length,) = struct.unpack(">I", sock.recv(4, socket.MSG_WAITALL))
    return w.decode_peer(sock.recv(length, socket.MSG_WAITALL))


@contextlib.contextmanager
def _peer(behaviour: str) -> Iterator[str]:
    """A fake peer at 127.0.0.1:PORT (yielded) that proves KEY and answers one fetch:
    ``whole`` sends the share, ``dies`` half of its bytes then closes, ``other`` offers
    step 2 instead."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        with contextlib.suppress(OSError), listener:
            sock, _ = listener.accept()
            with sock:
                hello = _read(sock)
                assert isinstance(hello, w.Hello)
                mine = w.new_nonce()
                sock.sendall(
                    w.encode_peer(w.Challenge(mine, w.proof(KEY, "accept", hello.nonce, mine)))
                )
                proof = _read(sock)
                assert isinstance(proof, w.Proof)
                assert w.proven(KEY, "connect", hello.nonce, mine, proof.proof)
                fetch = _read(sock)
                assert isinstance(fetch, w.FetchReplica)
                ref = fetch.ref
                if behaviour == "other":
                    ref = w.ReplicaRef(ref.root, ref.options, ref.step + 1, ref.rank)
                sock.sendall(w.encode_peer(w.PushReplica(ref, FILES, len(SHARE))))
                if behaviour == "other":
                    return
                go = _read(sock)
                assert go == w.PeerDone(True, "send")
                if behaviour == "dies":
                    sock.sendall(SHARE[: len(SHARE) // 2])
                    return
                sock.sendall(SHARE)
                assert _read(sock) == w.PeerDone(True)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        thread.join(10)


def _closed_port() -> str:
    with socket.create_server(("127.0.0.1", 0)) as server:
        return f"127.0.0.1:{server.getsockname()[1]}"  # closed once this returns


def _lookup(socket_path: str, peers: list[str]) -> p.Message:
    """Join JOB with ``peers`` after this service, then ask for rank 0's share of step 1."""
    reply = status(socket_path)
    assert reply.peer_address is not None
    me = p.PeerService(reply.service, reply.peer_address, [1])
    others = [p.PeerService(f"peer{i}", a, [0]) for i, a in enumerate(peers)]
    conn = connect(socket_path, start=False)
    try:
        conn.request(
            p.JoinPeers,
            root=ROOT,
            storage_options=None,
            job=JOB,
            key=KEY,
            ranks=[1],
            replicas=0,
            services=[me, *others],
        )
        found, fd = conn.request(p.Lookup, root=ROOT, storage_options=None, step=1, rank=0)
        if fd is not None:
            with os.fdopen(fd, "rb") as held:
                assert held.read(len(SHARE)) == SHARE  # the bytes lent are the peer's
    finally:
        conn.close()
    return found


@pytest.mark.timeout(120)
def test_a_fetch_skips_refused_dying_and_wrong_peers_and_takes_a_whole_share() -> None:
    with running_service("--peer-address", "127.0.0.1") as service:
        with _peer("dies") as dying, _peer("other") as other:
            found = _lookup(service.socket, [_closed_port(), dying, other])
        assert isinstance(found, p.NotHeld)
        reply = status(service.socket)
        assert reply.replicas_held == 0  # nothing of a broken transfer is kept
        assert sum(reply.replica_failures.values()) >= 2  # refused, died (wrong: skipped)
        assert reply.bytes_staged == 0  # the half-filled segment was freed
        with _peer("dies") as dying, _peer("whole") as whole:
            found = _lookup(service.socket, [dying, whole])
        assert isinstance(found, p.Held)
        assert found.source == "peer"
        assert found.files == FILES
        assert status(service.socket).replicas_held == 1
