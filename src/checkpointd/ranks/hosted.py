"""A many-rank writer whose saves the checkpoint service writes: the group, re-keyed so
that the service can reach it after the trainer is gone.

A service cannot use the trainer's view of the job's c10d store (a Python object
with prefixes torch does not expose), so a service writer's group lives under a
key space of its own, ``checkpointd/svc/{space}/``, directly on the job's TCP
store: rank 0 draws ``space`` and posts it through the trainer's group (whose keys
are private to this job incarnation); every rank's service then opens its own
connection to that TCP store (``open_hosted``). The service beats for its rank,
the trainer does not: a rank is alive as long as the process that writes its
share is. torch is imported lazily.
"""

from __future__ import annotations

import datetime
import secrets
from typing import Any

import msgspec

from checkpointd.errors import InvalidArgumentError, RankFailedError
from checkpointd.ranks.group import Group

__all__ = ["HostedGroup", "for_service", "open_hosted"]


class HostedGroup(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a service finds a rank's group: the job's TCP store, the key space, the
    rank, the world size and the writer's token."""

    host: str
    port: int
    prefix: str
    rank: int
    world_size: int
    token: str
    ranks: list[int]
    """The group's global ranks (a sub-group's; the world's for the default group)."""
    join_seconds: float
    """The writer's ``join_seconds``: how long the service waits for a rank to join."""


def _tcp_store(group: Group) -> Any:
    """The TCP store under the trainer's prefixed job store; InvalidArgumentError if the
    job's store is not a TCP store (the service must connect to it)."""
    from torch._C._distributed_c10d import TCPStore

    store = group.store
    while True:
        under = getattr(store, "underlying_store", None)
        if under is None:
            break
        store = under
    if not isinstance(store, TCPStore):
        raise InvalidArgumentError(
            f"a many-rank writer through the checkpoint service needs the job's store to be "
            f"a TCP store (tcp:// or env:// init, torchrun), not {type(store).__name__}: use "
            "service=None"
        )
    return store


def for_service(group: Group) -> Group:
    """The trainer's group re-keyed for the service (no heartbeat here; ``group`` is
    closed), with ``hosted`` set: what the service needs to open it. Every rank calls
    this when it makes the writer, in the same order. Caller thread, blocking."""
    try:
        tcp = _tcp_store(group)
        if group.rank == 0:
            space = secrets.token_hex(8)
            group.store.set("space", space)
        else:
            group.store.wait(["space"], datetime.timedelta(seconds=group.join_seconds))
            space = group.store.get("space").decode()
    except InvalidArgumentError:
        group.close()
        raise
    except Exception as exc:
        group.close()
        raise RankFailedError(
            f"rank 0 did not share the service writer's key space ({type(exc).__name__}: {exc})"
        ) from None
    from torch.distributed.distributed_c10d import PrefixStore

    prefix = f"checkpointd/svc/{space}/"
    address = HostedGroup(
        tcp.host,
        tcp.port,
        prefix,
        group.rank,
        group.world_size,
        group.token,
        list(group.ranks),
        group.join_seconds,
    )
    group.close()
    store = PrefixStore(prefix, tcp.clone())
    hosted = Group(
        store,
        group.rank,
        group.world_size,
        group.token,
        group.ranks,
        heartbeat=False,
        join_seconds=group.join_seconds,
    )
    hosted.hosted = address
    return hosted


def open_hosted(address: HostedGroup) -> Group:
    """The service's side: a connection of its own to the job's TCP store and the group
    in ``address``'s key space, beating for its rank. Worker thread, blocking."""
    from torch._C._distributed_c10d import PrefixStore, TCPStore

    timeout = datetime.timedelta(seconds=address.join_seconds)
    tcp = TCPStore(
        address.host, address.port, is_master=False, wait_for_workers=False, timeout=timeout
    )
    store = PrefixStore(address.prefix, tcp)
    return Group(
        store,
        address.rank,
        address.world_size,
        address.token,
        tuple(address.ranks),
        join_seconds=address.join_seconds,
    )
