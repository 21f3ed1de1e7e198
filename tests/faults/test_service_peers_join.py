"""A rank joins its own service to the job whatever the other ranks' services are: one
rank with a service and a peer port, one without a service (it publishes no address),
exchanging through a real store; the first rank's service then knows the job (its peer
port answers the job's name with a ``Challenge``)."""

from __future__ import annotations

import socket
import struct
import threading
from datetime import timedelta

import msgspec
from torch.distributed import HashStore

from checkpointd.daemon.client.client import connect
from checkpointd.daemon.client.peering import join_store
from checkpointd.daemon.wire import peers as w
from checkpointd.daemon.wire import protocol as p
from tests.support.service import running_service


def _answer_to_hello(address: str, job: str) -> list[w.PeerMessage]:
    """What the peer port at ``address`` sends back to a Hello naming ``job``."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(w.encode_peer(w.Hello(job=job, nonce=w.new_nonce())))
        got = b""
        while len(got) < 4 or len(got) < 4 + struct.unpack(">I", got[:4])[0]:
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
    if len(got) < 4:
        return []
    (length,) = struct.unpack(">I", got[:4])
    return [w.decode_peer(got[4 : 4 + length])]


def test_a_rank_joins_its_service_when_the_last_rank_has_no_service() -> None:
    store = HashStore()
    store.set_timeout(timedelta(seconds=30))
    with running_service("--peer-address", "127.0.0.1") as service:
        conn = connect(service.socket, start=False)
        listed: list[list[p.PeerService]] = []
        try:
            without = threading.Thread(
                target=join_store,
                args=(None, store, 1, 2),
                kwargs={"root": "/tmp/joined-root", "storage_options": None, "replicas": 1},
            )
            without.start()
            listed.append(
                join_store(
                    conn, store, 0, 2, root="/tmp/joined-root", storage_options=None, replicas=1
                )
            )
            without.join(60)
        finally:
            conn.close()
        (only,) = listed[0]
        assert only.ranks == [0]
        job, _key = msgspec.json.decode(store.get("peers/job"), type=list[str])
        answer = _answer_to_hello(only.address, job)
        assert [type(m) for m in answer] == [w.Challenge], "rank 0's service never joined the job"
