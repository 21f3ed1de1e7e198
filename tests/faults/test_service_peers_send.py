"""A replica's bytes on real TCP when the other side is slow or gone (issue 34): a peer
that stops sending inside the bytes of a replica it pushes, and one that stops reading
the bytes of a replica it fetched, are each cut off within the replica's deadline
(``FRAME_SECONDS`` plus its size at ``PEER_MIN_BYTES_PER_SECOND``; both set low in the
service) while the service goes on serving its local clients and other peers; a share
pushed to a peer whose port is refused (its node died) is counted in ``replica_failures``
and nothing else breaks. The stalling peers are test sockets that prove the job's key; the
dead peer is a real service of a real 2-rank job, killed while its peer's push waits.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import struct
import time
from pathlib import Path

import pytest

from checkpointd.daemon.client.client import connect, status
from checkpointd.daemon.server.memtier import root_key
from checkpointd.daemon.server.replicas import ref_of
from checkpointd.daemon.wire import peers as w
from checkpointd.daemon.wire import protocol as p
from checkpointd.format.checksum import crc32c
from tests.integration.test_sharded import job
from tests.support.service import (
    join_peer_job,
    running_service,
    socket_folder,
    start_service,
)

KEY = os.urandom(32)
JOB = "send-faults-job"
ROOT = "/tmp/peers-send-root"
SHARE = os.urandom(1 << 20) * 32  # 32 MiB: far more than loopback's socket buffers hold
FILES = [p.HeldFile("000000000001/a.safetensors", b"", 0, len(SHARE), crc32c(SHARE))]
REF = ref_of(root_key(ROOT, None), 1, 0)  # rank 0's share of step 1, as services name it
FRAME_SECONDS = 2.0
RATE = 64 * 2**20  # the share's bytes take 0.5 s at the slowest allowed
DEADLINE = FRAME_SECONDS + len(SHARE) / RATE
TUNABLES = json.dumps({"FRAME_SECONDS": FRAME_SECONDS, "PEER_MIN_BYTES_PER_SECOND": RATE})


def _exactly(sock: socket.socket, size: int) -> bytes:
    """``size`` bytes from ``sock`` (a socket with a timeout returns parts: no WAITALL)."""
    got = bytearray(size)
    view, done = memoryview(got), 0
    while done < size:
        moved = sock.recv_into(view[done:])
        assert moved, f"closed after {done} of {size} bytes"
        done += moved
    return bytes(got)


def _read(sock: socket.socket) -> w.PeerMessage:
    (length,) = struct.unpack(">I", _exactly(sock, 4))
    return w.decode_peer(_exactly(sock, length))


def _proven(address: str, receive_buffer: int | None = None) -> socket.socket:
    """A connection to ``address`` that proved KEY (and checked the service's proof)."""
    host, port = address.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:  # before connecting: the window stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(DEADLINE + 30)
    sock.connect((host, int(port)))
    mine = w.new_nonce()
    sock.sendall(w.encode_peer(w.Hello(JOB, mine)))
    challenge = _read(sock)
    assert isinstance(challenge, w.Challenge)
    assert w.proven(KEY, "accept", mine, challenge.nonce, challenge.proof)
    sock.sendall(w.encode_peer(w.Proof(w.proof(KEY, "connect", mine, challenge.nonce))))
    return sock


def _until_closed(sock: socket.socket) -> int:
    """Bytes received until the service closes ``sock``."""
    got = 0
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(1 << 20):
            got += len(chunk)
    sock.close()
    return got


def _push(address: str, whole: bool) -> socket.socket:
    """Offer REF's share; send all of its bytes, or 1 MiB of them and then nothing."""
    sock = _proven(address)
    sock.sendall(w.encode_peer(w.PushReplica(REF, FILES, len(SHARE))))
    assert _read(sock) == w.PeerDone(True, "send")
    sock.sendall(SHARE if whole else SHARE[: 1 << 20])
    return sock


@pytest.mark.timeout(120)
def test_a_stalled_sender_or_receiver_of_a_replica_is_cut_off_and_the_service_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHECKPOINTD_TEST_TUNABLES", TUNABLES)
    gate = str(tmp_path / "open")
    Path(gate).touch()  # held-serve for its tunables only: nothing is held back
    with running_service("--peer-address", "127.0.0.1", gate=gate) as service:
        address = join_peer_job(service.socket, root=ROOT, job=JOB, key=KEY)

        # a peer pushing a replica stops inside its bytes: cut off, nothing held
        started = time.monotonic()
        stalled = _push(address, whole=False)
        assert status(service.socket).peer_address == address  # serving meanwhile
        assert _until_closed(stalled) == 0  # no answer to a replica that never arrived
        took = time.monotonic() - started
        assert DEADLINE - 0.5 <= took <= DEADLINE + 5, took
        reply = status(service.socket)
        assert reply.replicas_held == 0
        assert reply.bytes_staged == 0  # the half-filled segment went back

        # the same replica, sent whole, is held
        whole = _push(address, whole=True)
        assert _read(whole) == w.PeerDone(True)
        whole.close()
        assert status(service.socket).replicas_held == 1

        # a peer fetching it stops reading its bytes: the service's sending side gives up
        slow = _proven(address, receive_buffer=64 * 1024)
        slow.sendall(w.encode_peer(w.FetchReplica(REF)))
        assert _read(slow) == w.PushReplica(REF, FILES, len(SHARE))
        started = time.monotonic()
        slow.sendall(w.encode_peer(w.PeerDone(True, "send")))
        # meanwhile another peer fetches the share whole
        fine = _proven(address)
        fine.sendall(w.encode_peer(w.FetchReplica(REF)))
        assert _read(fine) == w.PushReplica(REF, FILES, len(SHARE))
        fine.sendall(w.encode_peer(w.PeerDone(True, "send")))
        assert _exactly(fine, len(SHARE)) == SHARE
        fine.sendall(w.encode_peer(w.PeerDone(True)))
        fine.close()
        time.sleep(max(0.0, started + DEADLINE + 1 - time.monotonic()))
        slow.settimeout(FRAME_SECONDS + 10)
        got = _until_closed(slow)  # what the kernel had buffered, then the end
        assert got < len(SHARE), got  # cut off: never the whole share
        reply = status(service.socket)
        assert reply.replicas_held == 1  # the share stays held, unpinned
        assert reply.clients == 0


@pytest.mark.timeout(240)
def test_a_push_to_a_dead_peer_is_counted_and_nothing_else_breaks(tmp_path: Path) -> None:
    gate = str(tmp_path / "open")  # the services' pushes wait for it
    args = ("--peer-address", "127.0.0.1")
    folders = [socket_folder(), socket_folder()]
    first = start_service(folders[0], *args, gate=gate, hold="peer_push")
    second = start_service(folders[1], *args, gate=gate, hold="peer_push")
    try:
        root = str(tmp_path / "root")
        sockets = f"{first.socket},{second.socket}"
        job(
            "save",
            "fsdp2",
            root,
            tmp_path / "save",
            2,
            CHECKPOINTD_TEST_SERVICES=sockets,
            CHECKPOINTD_TEST_REPLICAS="1",
        )
        second.kill()  # the node of rank 1 dies before rank 0's share reaches it
        Path(gate).touch()
        deadline = time.monotonic() + 30
        while not (failures := status(first.socket).replica_failures):
            assert time.monotonic() < deadline, first.log_text()[-3000:]
            time.sleep(0.05)
        reply = status(first.socket)
        assert all(why.startswith("send: ") for why in failures), failures
        assert sum(failures.values()) == 1
        assert reply.replicas_sent == 0
        assert reply.saves_in_flight == 0
        assert list(reply.kept.values()) == [[1]]  # its own share stays held
        assert "replica of rank 0 step 1" in first.log_text()
        # and it still lends it: a restore on the same node finds it
        conn = connect(first.socket, start=False)
        try:
            found, fd = conn.request(p.Lookup, root=root, storage_options=None, step=1, rank=0)
            assert isinstance(found, p.Held)
            assert found.source == "memory"
            assert fd is not None
            os.close(fd)
        finally:
            conn.close()
    finally:
        first.stop()
        second.stop()
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.timeout(120)
def test_a_replica_damaged_on_the_wire_is_checked_on_arrival_and_never_held(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CHECKPOINTD_TEST_TUNABLES", TUNABLES)
    gate = str(tmp_path / "open")
    Path(gate).touch()
    with running_service("--peer-address", "127.0.0.1", gate=gate) as service:
        address = join_peer_job(service.socket, root=ROOT, job=JOB, key=KEY)
        # a peer that proves the key offers REF's files with their CRC32Cs, then sends
        # bytes with one of them flipped (as a bad NIC or a bit flip in its memory would)
        damaged = bytearray(SHARE)
        damaged[len(SHARE) // 2] ^= 0x01
        sock = _proven(address)
        sock.sendall(w.encode_peer(w.PushReplica(REF, FILES, len(SHARE))))
        assert _read(sock) == w.PeerDone(True, "send")
        sock.sendall(damaged)
        assert _read(sock) == w.PeerDone(False, "damaged on arrival")
        sock.close()
        reply = status(service.socket)
        assert reply.replicas_held == 0
        assert reply.replica_failures == {"damaged on arrival": 1}
        assert reply.bytes_staged == 0  # its segment went back
        assert FILES[0].path in service.log_text()

        # the same share, sent whole, is held
        whole = _push(address, whole=True)
        assert _read(whole) == w.PeerDone(True)
        whole.close()
        reply = status(service.socket)
        assert reply.replicas_held == 1
        assert reply.replica_failures == {"damaged on arrival": 1}
