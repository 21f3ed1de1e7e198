"""Many ranks, one writer each: the group a writer saves with, and how its ranks talk.

Coordination goes through the job's c10d store (the key-value store that
torch.distributed was initialized with), never through a collective on the
training's process group, which would interleave with the training's own
collectives. Each writer of a multi-rank job owns a key prefix in that store;
a heartbeat thread per writer bumps a counter there, so another rank tells a
dead rank (its counter stops) from a slow one (its counter moves). torch is
imported lazily: ``import checkpointd`` stays free of it.
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import threading
import time
from collections.abc import Mapping
from typing import Any, Final

from checkpointd import tunables
from checkpointd.errors import InvalidArgumentError, RankFailedError

__all__ = ["LOCAL", "Group", "Liveness", "PerRank", "rank_key", "resolve_group", "split_state"]


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

_writer_numbers = itertools.count()


class PerRank:
    """``checkpointd.PerRank(obj)``: a component whose state differs by rank (a data loader,
    per-rank counters). Every rank writes and restores its own; never compared."""

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

    ``rank``/``world_size`` are this process's place in the group, ``publisher`` the
    rank that publishes manifests and runs retention. ``store`` is a clone of the
    job's c10d store (a connection of its own) under a prefix owned by this writer;
    ``token`` is agreed by every rank when the writer is made (it names the files).
    ``join_seconds`` is how long a save waits for a live rank that has not joined it
    (the writer's option). Thread-safe: c10d stores lock each operation.
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        token: str,
        *,
        join_seconds: float,
    ) -> None:
        self.store = store
        self.join_seconds = join_seconds
        self.rank = rank
        self.world_size = world_size
        self.publisher = 0
        self.token = token
        self._attempts: dict[int, int] = {}
        self._stop = threading.Event()
        self._beat = threading.Thread(
            target=self._heartbeat, name="checkpointd-heartbeat", daemon=True
        )
        self._beat.start()

    @property
    def publishes(self) -> bool:
        """True on the rank that publishes manifests and runs retention."""
        return self.rank == self.publisher

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

    def close(self) -> None:
        """Stop the heartbeat and say so (other ranks then know this rank left)."""
        self._stop.set()
        self._beat.join()
        with contextlib.suppress(Exception):  # the store is gone: others see a stale heartbeat
            self.store.set(f"closed/{self.rank}", b"1")


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


def _default_group_info(process_group: Any) -> tuple[Any, int, int] | None:
    """(store, rank, world size) of ``process_group`` (None: the default group), or None
    if torch.distributed is not initialized."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not dist.is_available() or not dist.is_initialized():
        if process_group is not None:
            raise InvalidArgumentError(
                "process_group was given but torch.distributed is not initialized"
            )
        return None
    store = distributed_c10d._get_default_store()
    rank = dist.get_rank(process_group)
    world_size = dist.get_world_size(process_group)
    if process_group is not None and world_size != dist.get_world_size():
        raise InvalidArgumentError(
            "only the default process group (process_group=None) or checkpointd.LOCAL are "
            "supported for now"
        )
    return store, rank, world_size


def resolve_group(process_group: Any, *, join_seconds: float) -> Group | None:
    """The Group a writer made with ``process_group`` saves with; None to save alone.

    None means the default group when torch.distributed is initialized (and alone
    otherwise, or with one rank); LOCAL means alone. Every rank of the group must
    make its writers in the same order: the n-th writer of each rank agree on a
    token through the store (rank 0 draws it; others wait up to ``join_seconds``).
    Caller thread, blocking.
    """
    if process_group is LOCAL:
        return None
    info = _default_group_info(process_group)
    if info is None or info[2] == 1:
        return None
    from torch.distributed.distributed_c10d import PrefixStore

    job_store, rank, world_size = info
    number = next(_writer_numbers)
    store = PrefixStore(f"checkpointd/w{number}/", job_store.clone())
    if rank == 0:
        token = secrets.token_hex(4)
        store.set("token", token)
    else:
        try:
            store.wait(["token"], _timedelta(join_seconds))
        except Exception:
            raise RankFailedError(
                f"rank 0 did not make its writer number {number} within "
                f"{join_seconds}s: every rank must make the same writers in the "
                "same order (or pass process_group=checkpointd.LOCAL to save alone)"
            ) from None
        token = store.get("token").decode()
    return Group(store, rank, world_size, token, join_seconds=join_seconds)


def _timedelta(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)


def per_rank_targets(
    manifest: Any, targets: Mapping[str, Any], strict: bool
) -> tuple[dict[str, Any], set[str], tuple[str, ...]]:
    """``targets`` as restore reads them: ``PerRank`` targets unwrapped (the dict given to
    ``save`` restores as it is), a per-rank component's target mapped to this rank's
    component; the components of other ranks (to ignore); the per-rank targets skipped
    because the world size changed (``strict=False``; else RestoreMismatchError).
    This process is rank 0 of 1 unless torch.distributed is initialized. Training thread."""
    from checkpointd.errors import RestoreMismatchError

    targets = {n: t.obj if isinstance(t, PerRank) else t for n, t in targets.items()}
    if not manifest.per_rank:
        return targets, set(), ()
    rank, world = _rank_and_world()
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
                f"has {world}: pass strict=False to restore without it"
            )
        else:
            skipped.append(name)
    for name, keys in manifest.per_rank.items():
        mine = keys[rank] if len(keys) == world and name not in skipped else None
        others.update(k for k in keys if k != mine)
    return mapped, others, tuple(skipped)


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
