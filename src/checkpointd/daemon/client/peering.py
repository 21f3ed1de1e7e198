"""A job's ranks find each other's services, and tell their own: the trainer's side of
peer replicas (daemon/server/replicas.py, peerlink.py).

Through a store every rank of the job reaches (the writer's c10d key space, or the
job's store for a restore): the first rank draws the job's key (random; it stays in
the job's store and in the services, never on the peer port), each rank publishes its
service's identity and peer address, and once all have, each tells its own service the
job's services in rank order (``JoinPeers``), then waits until every rank has (so no
service hears from a peer before it knows the job). A rank whose service has no peer
port publishes none; the others go on without it. Caller's thread, blocking: a
collective over the store (every rank calls it, in the same order).
"""

from __future__ import annotations

import datetime
import hashlib
import secrets
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from checkpointd import tunables
from checkpointd.daemon.client.client import Connection
from checkpointd.daemon.wire import protocol as p
from checkpointd.errors import RankFailedError

if TYPE_CHECKING:
    from checkpointd.ranks.group import Group

__all__ = ["join_peers", "join_restore", "join_store"]

_restores: dict[str, int] = {}  # restores joined by this process, per group and root


def join_peers(
    conn: Connection,
    group: Group,
    root: str,
    storage_options: Mapping[str, Any] | None,
    replicas: int,
) -> None:
    """A writer's rank joins its service (``conn``) to its job, with ``replicas``, through
    the writer's key space in the job's store (``group``); ``join_store``'s errors."""
    join_store(
        conn,
        group.store,
        group.rank,
        group.world_size,
        root=root,
        storage_options=storage_options,
        replicas=replicas,
    )


def join_restore(
    service: str,
    root: str,
    storage_options: Mapping[str, Any] | None,
    process_group: Any,
) -> None:
    """A restoring rank of a many-rank job (``process_group``, as restore takes it) joins
    its service to the job, so that it may fetch the shares it lacks from the job's
    other services; nothing for a job of one rank. A rank whose service does not answer
    still takes part (it publishes no address)."""
    from checkpointd.daemon.client.client import connect
    from checkpointd.errors import ServiceError
    from checkpointd.ranks.group import place_in

    rank, world = place_in(process_group)
    if world == 1:
        return
    import torch.distributed as dist
    from torch.distributed import distributed_c10d
    from torch.distributed.distributed_c10d import PrefixStore

    ranks = (
        list(range(world)) if process_group is None else dist.get_process_group_ranks(process_group)
    )
    # torch has no public accessor for the job's store; every rank of the job has it
    job_store = distributed_c10d._get_default_store()  # noqa: SLF001 - torch's, no public accessor
    name = hashlib.sha256(msgspec.json.encode([ranks, root])).hexdigest()[:16]
    number = _restores.get(name, 0)
    _restores[name] = number + 1
    store = PrefixStore(f"checkpointd/restore/{name}/{number}/", job_store)
    try:
        conn: Connection | None = connect(service, start=False)
    except ServiceError:
        conn = None
    try:
        join_store(conn, store, rank, world, root=root, storage_options=storage_options, replicas=0)
    finally:
        if conn is not None:
            conn.close()


def join_store(
    conn: Connection | None,
    store: Any,
    rank: int,
    world: int,
    *,
    root: str,
    storage_options: Mapping[str, Any] | None,
    replicas: int,
    seconds: float | None = None,
) -> list[p.PeerService]:
    """Exchange the ranks' services through ``store`` (keys under ``peers/``) and join
    this rank's service (``conn``) to the job for ``root``; the job's services in rank
    order. RankFailedError if a rank does not publish within ``seconds`` (default
    ``tunables.PEER_STORE_SECONDS``)."""
    wait = datetime.timedelta(seconds=seconds or tunables.PEER_STORE_SECONDS)
    service, address = "", None
    if conn is not None:
        reply, _ = conn.request(p.Status)
        assert isinstance(reply, p.StatusReply)
        service, address = reply.service, reply.peer_address
    try:
        if rank == 0:
            job = [secrets.token_hex(8), secrets.token_hex(32)]
            store.set("peers/job", msgspec.json.encode(job))
        store.set(f"peers/{rank}", msgspec.json.encode([service, address]))
        store.wait(["peers/job", *(f"peers/{r}" for r in range(world))], wait)
        job_id, key = msgspec.json.decode(store.get("peers/job"), type=list[str])
        entries = [
            msgspec.json.decode(store.get(f"peers/{r}"), type=tuple[str, str | None])
            for r in range(world)
        ]
    except Exception as exc:
        raise RankFailedError(
            f"the job's ranks did not share their services' peer addresses within "
            f"{wait.total_seconds():g}s ({type(exc).__name__}: {exc})"
        ) from None
    services: dict[str, p.PeerService] = {}
    for r, (name, reached_at) in enumerate(entries):
        if reached_at is None:
            continue
        if name not in services:
            services[name] = p.PeerService(name, reached_at, [])
        services[name].ranks.append(r)
    listed = list(services.values())
    if conn is not None and address is not None:
        conn.request(
            p.JoinPeers,
            root=root,
            storage_options=None if storage_options is None else dict(storage_options),
            job=job_id,
            key=bytes.fromhex(key),
            ranks=[rank],
            replicas=replicas,
            services=listed,
        )
    try:
        store.set(f"peers/joined/{rank}", b"1")
        store.wait([f"peers/joined/{r}" for r in range(world)], wait)
    except Exception as exc:
        raise RankFailedError(
            f"the job's ranks did not join their services to the job within "
            f"{wait.total_seconds():g}s ({type(exc).__name__}: {exc})"
        ) from None
    return listed
