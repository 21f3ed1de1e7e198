"""Many ranks, one writer each: the group a writer saves with, and how its ranks talk.

Coordination goes through the job's c10d store (the key-value store that
torch.distributed was initialized with), never through a collective on the
training's process group, which would interleave with the training's own
collectives. A writer saves with the default group or with a sub-group (its own
ranks only); each writer owns a key prefix in that store, named by its group's
ranks and its root, so groups that share the store never meet each other's keys;
a heartbeat thread per writer bumps a counter there, so another rank tells a
dead rank (its counter stops) from a slow one (its counter moves). torch is
imported lazily: ``import checkpointd`` stays free of it.
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, Final

import msgspec

from checkpointd import tunables
from checkpointd.errors import InvalidArgumentError, RankFailedError

__all__ = [
    "LOCAL",
    "Group",
    "Liveness",
    "PerRank",
    "per_rank_targets",
    "place_in",
    "rank_key",
    "resolve_group",
    "split_state",
]


class _Local:
    """The type of ``checkpointd.LOCAL``."""

    _instance: _Local | None = None

    def __new__(cls) -> _Local:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "checkpointd.LOCAL"

    def __reduce__(self) -> str:
        return "LOCAL"


LOCAL: Final = _Local()
"""``process_group=checkpointd.LOCAL``: this process saves alone, as if torch.distributed
were not initialized (its own checkpoint; no other rank takes part)."""

_writers: dict[str, int] = {}
"""Writers made so far in this process, per pairing key (a group's ranks and a root)."""
_writers_lock = threading.Lock()


class PerRank:
    """``checkpointd.PerRank(obj)``: a component whose state differs by rank.

    A data loader, per-rank counters: every rank writes and restores its own; never
    compared between ranks.

    Args:
        obj: The component (anything a component may be: a Stateful, a tree...).
    """

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __repr__(self) -> str:
        return f"PerRank({self.obj!r})"


def rank_key(name: str, rank: int) -> str:
    """The component that holds ``rank``'s state of per-rank component ``name``."""
    return f"{name}-rank{rank}"


def split_state(
    state: Mapping[str, Any], rank: int | None
) -> tuple[dict[str, Any], dict[str, str]]:
    """``state`` as captured: per-rank components (PerRank, RNGState) renamed for ``rank``,
    and the map of those names to the given ones. ``rank`` None (a process saving alone):
    PerRank is unwrapped and nothing is renamed. Caller thread."""
    from checkpointd.state.rng import RNGState

    if not isinstance(state, Mapping):
        return state, {}  # type: ignore[unreachable]  # capture refuses it with its message
    captured: dict[str, Any] = {}
    per_rank: dict[str, str] = {}
    for name, value in state.items():
        ranked = isinstance(value, PerRank | RNGState)
        plain = value.obj if isinstance(value, PerRank) else value
        if rank is None or not ranked or not isinstance(name, str):
            captured[name] = plain
            continue
        key = rank_key(name, rank)
        per_rank[key] = name
        captured[key] = plain
    clash = set(per_rank) & {n for n in captured if n not in per_rank}
    if clash:
        raise InvalidArgumentError(
            f"component names {sorted(clash)} are taken by per-rank components"
        )
    return captured, per_rank


class Group:
    """The ranks that save one checkpoint together, and this writer's view of the store.

    ``rank``/``world_size`` are this process's place in the group (group ranks: what
    the manifest records and the store's keys use), ``ranks`` the group's global ranks
    in group-rank order, ``publisher`` the rank that publishes manifests and runs
    retention. ``store`` is a clone of the job's c10d store (a connection of its own)
    under a prefix owned by this writer; ``token`` is agreed by every rank when the
    writer is made (it names the files). ``join_seconds`` is how long a save waits for
    a live rank that has not joined it (the writer's option). Thread-safe: c10d stores
    lock each operation.
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        token: str,
        ranks: tuple[int, ...] | None = None,
        *,
        join_seconds: float,
        heartbeat: bool = True,
    ) -> None:
        self.store = store
        self.join_seconds = join_seconds
        self.rank = rank
        self.world_size = world_size
        self.ranks = tuple(range(world_size)) if ranks is None else ranks
        self.publisher = 0
        self.token = token
        self.hosted: Any = None
        """Where the service finds this group (ranks/hosted.py ``HostedGroup``), for a
        service writer's group; else None."""
        self._attempts: dict[int, int] = {}
        self._waiter = _connection(store)
        self._stop = threading.Event()
        self._beat = threading.Thread(
            target=self._heartbeat, name="checkpointd-heartbeat", daemon=True
        )
        if heartbeat:  # False: another process beats for this rank (ranks/hosted.py)
            self._beat.start()

    @property
    def publishes(self) -> bool:
        """True on the rank that publishes manifests and runs retention."""
        return self.rank == self.publisher

    def named(self, ranks: list[int]) -> str:
        """``ranks`` (group ranks) in words: "rank(s) [1]", with their global ranks where
        they differ (a sub-group)."""
        names = f"rank(s) {ranks}"
        if self.ranks == tuple(range(self.world_size)):
            return names
        return f"{names} of the group (global {[self.ranks[r] for r in ranks]})"

    def name(self, rank: int) -> str:
        """Group rank ``rank`` in words: "rank 1", or "rank 1 (global 2)" in a sub-group."""
        if self.ranks == tuple(range(self.world_size)):
            return f"rank {rank}"
        return f"rank {rank} (global {self.ranks[rank]})"

    def attempt(self, step: int) -> int:
        """The number of this writer's attempt at ``step`` (0 first). Caller thread."""
        number = self._attempts.get(step, 0)
        self._attempts[step] = number + 1
        return number

    def _heartbeat(self) -> None:
        """Bump this rank's counter until closed; stops quietly if the store goes away."""
        key = f"hb/{self.rank}"
        while True:
            try:
                self.store.add(key, 1)
            except Exception:
                return
            if self._stop.wait(tunables.HEARTBEAT_SECONDS):
                return

    def heartbeat(self, rank: int) -> int:
        """The heartbeat counter of ``rank`` (0 before it started). Blocking."""
        return int(self.store.add(f"hb/{rank}", 0))

    def closed(self, rank: int) -> bool:
        """True once ``rank`` closed its writer. Blocking."""
        return bool(self.store.check([f"closed/{rank}"]))

    def wait(self, key: str, seconds: float) -> bool:
        """Block until ``key`` is set (True) or ``seconds`` passed (False), on a connection
        of its own to the store (a TCPStore client runs one call at a time, so the
        heartbeat must not queue behind a wait). Raises what the store raises for
        anything but the timeout. Blocking."""
        import datetime

        try:
            self._waiter.wait([key], datetime.timedelta(seconds=seconds))
        except Exception as exc:
            if "timeout" not in str(exc).lower():
                raise
            return False
        return True

    def close(self) -> None:
        """Stop the heartbeat and say so (other ranks then know this rank left)."""
        self._stop.set()
        if self._beat.is_alive():
            self._beat.join()
        with contextlib.suppress(Exception):  # the store is gone: others see a stale heartbeat
            self.store.set(f"closed/{self.rank}", b"1")


def _connection(store: Any) -> Any:
    """A connection of its own to ``store`` for blocking waits (``Group.wait``), made with
    the group, while the store is known to be up: made later, after the rank hosting the
    store died, the connect would retry for the store's whole timeout. ``store`` itself
    for a store that cannot clone (its waits then share its connection)."""
    try:
        return store.clone()
    except Exception:
        return store


class Liveness:
    """Which ranks stopped beating: a counter that has not moved for STALE_SECONDS."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self._seen: dict[int, tuple[int, float]] = {}

    def dead(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` whose heartbeat has been still too long. Blocking."""
        now = time.monotonic()
        gone = []
        for rank in ranks:
            value = self.group.heartbeat(rank)
            last = self._seen.get(rank)
            if last is None or last[0] != value:
                self._seen[rank] = (value, now)
            elif now - last[1] > tunables.STALE_SECONDS:
                gone.append(rank)
        return gone


def _group_info(process_group: Any) -> tuple[Any, int, tuple[int, ...]] | None:
    """(job store, this process's rank in ``process_group``, the group's global ranks in
    group-rank order) for a group or the default one (None); None if torch.distributed is
    not initialized. Raises InvalidArgumentError for a group this process is not in."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not dist.is_available() or not dist.is_initialized():
        if process_group is not None:
            raise InvalidArgumentError(
                "process_group was given but torch.distributed is not initialized"
            )
        return None
    if process_group is None:
        ranks = tuple(range(dist.get_world_size()))
    elif process_group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(process_group) < 0:
        raise InvalidArgumentError(
            f"this process (rank {dist.get_rank()}) is not a member of process_group: only "
            "the group's ranks make its writers"
        )
    else:
        ranks = tuple(dist.get_process_group_ranks(process_group))
    # torch has no public accessor for the job's store; every rank of the job has it
    store = distributed_c10d._get_default_store()  # noqa: SLF001 - torch's, no public accessor
    return store, dist.get_rank(process_group), ranks


def _pairing_key(ranks: tuple[int, ...], root: str) -> str:
    """What the writers of one group on one root agree on without talking: their store
    prefix names the group's ranks and the root, so another group (or another root)
    sharing the job's store never meets their keys."""
    text = msgspec.json.encode([list(ranks), root])
    return hashlib.sha256(text).hexdigest()[:16]


def resolve_group(process_group: Any, root: str, *, join_seconds: float) -> Group | None:
    """The Group a writer of ``root`` made with ``process_group`` saves with; None to
    save alone.

    None means the default group when torch.distributed is initialized (and alone
    otherwise, or with one rank); LOCAL means alone; a process group (a pipeline stage,
    a subset of the ranks made by ``new_group``) means its ranks, and only they take
    part. The writers that save together are paired by the group's ranks, ``root``
    (the same URL on every rank) and their number among this process's writers of that
    group and root: every rank of the group makes its writers of a root in the same
    order. Group rank 0 draws the token; the others wait up to ``join_seconds``.
    Caller thread, blocking.
    """
    if process_group is LOCAL:
        return None
    info = _group_info(process_group)
    if info is None or len(info[2]) == 1:
        return None
    from torch.distributed.distributed_c10d import PrefixStore

    job_store, rank, ranks = info
    key = _pairing_key(ranks, root)
    with _writers_lock:
        number = _writers.get(key, 0)
        _writers[key] = number + 1
    store = PrefixStore(f"checkpointd/{key}/w{number}/", job_store.clone())
    if rank == 0:
        token = secrets.token_hex(4)
        store.set("token", token)
    else:
        try:
            store.wait(["token"], _timedelta(join_seconds))
        except Exception:
            first = "rank 0" if ranks[0] == 0 else f"rank {ranks[0]} (rank 0 of the group)"
            raise RankFailedError(
                f"{first} did not make its writer number {number} of {root} within "
                f"{join_seconds}s: every rank of the group must make the same "
                "writers of a root in the same order (or pass "
                "process_group=checkpointd.LOCAL to save alone)"
            ) from None
        token = store.get("token").decode()
    return Group(store, rank, len(ranks), token, ranks, join_seconds=join_seconds)


def _timedelta(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)


def per_rank_targets(
    manifest: Any, targets: Mapping[str, Any], strict: bool, place: tuple[int, int] = (0, 1)
) -> tuple[dict[str, Any], set[str], tuple[str, ...]]:
    """``targets`` as restore reads them: ``PerRank`` targets unwrapped (the dict given to
    ``save`` restores as it is), a per-rank component's target mapped to this rank's
    component; the components of other ranks (to ignore); the per-rank targets skipped
    because the world size changed (``strict=False``; else RestoreMismatchError).
    ``place``: this process's (rank, world size) in the group that restores
    (``place_in``). Training thread."""
    from checkpointd.errors import RestoreMismatchError

    targets = {n: t.obj if isinstance(t, PerRank) else t for n, t in targets.items()}
    if not manifest.per_rank:
        return targets, set(), ()
    rank, world = place
    mapped: dict[str, Any] = {}
    others: set[str] = set()
    skipped: list[str] = []
    for name, target in targets.items():
        keys = manifest.per_rank.get(name)
        if keys is None:
            mapped[name] = target
        elif len(keys) == world:
            mapped[keys[rank]] = target
        elif strict:
            raise RestoreMismatchError(
                f"per-rank component {name!r} was saved by {len(keys)} ranks and this job "
                f"has {world}: pass strict=False to restore without it (or, if a "
                "sub-group saved it, that group as process_group=)"
            )
        else:
            skipped.append(name)
    for name, keys in manifest.per_rank.items():
        mine = keys[rank] if len(keys) == world and name not in skipped else None
        others.update(k for k in keys if k != mine)
    return mapped, others, tuple(skipped)


def place_in(process_group: Any) -> tuple[int, int]:
    """(rank, world size) of this process in ``process_group`` as restore sees it: LOCAL,
    or torch.distributed not initialized, is (0, 1); None the default group; a group
    its own ranks (InvalidArgumentError if this process is not in it). Caller thread."""
    if process_group is LOCAL:
        return 0, 1
    if process_group is None and "torch.distributed" not in sys.modules:
        return 0, 1
    info = _group_info(process_group)
    if info is None:
        return 0, 1
    return info[1], len(info[2])
