"""Peer replicas on the service's side: the jobs whose trainers joined their peers here,
which services a rank's share goes to, and the shares held for other nodes.

A trainer of a many-rank job tells its service the job's key and its services in rank
order (``JoinPeers``): that is a ``PeerJob``. A rank's share of a step, once the memory
tier holds it, goes to the ``replicas`` services after this one in that order (a ring
over the job's distinct services); one that arrives from another service is held here
(``Replicas``), per root, the newest ``keep`` steps (``--keep-in-memory``), dropped
first when memory runs short (oldest first), never counted as this node's own steps.
A replica is named by its root's resolved name and its storage options' SHA-256
(``wire.peers.ReplicaRef``): the options, which may hold credentials, never leave the
node. On the service's event loop. No torch here.
"""

from __future__ import annotations

import collections
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from checkpointd.daemon.server.memtier import HeldCheckpoint, MemoryTier, RootKey
from checkpointd.daemon.wire import protocol as p
from checkpointd.daemon.wire.peers import ReplicaRef, options_digest
from checkpointd.daemon.wire.shm import MappedSegment

__all__ = ["PeerJob", "Replicas", "own_share", "ref_of", "ring"]

_log = logging.getLogger(__name__)


def ref_of(key: RootKey, step: int, rank: int) -> ReplicaRef:
    """The name between services of ``rank``'s share of ``step`` of root ``key``."""
    return ReplicaRef(key.name, options_digest(key.options), step, rank)


def ring(services: list[p.PeerService], own: str, count: int) -> list[p.PeerService]:
    """The ``count`` services after ``own`` in ``services`` (rank order), wrapping, never
    ``own`` itself: fewer where the job has fewer others."""
    names = [s.service for s in services]
    if own not in names:
        return []
    at = names.index(own)
    others = services[at + 1 :] + services[:at]
    return others[:count]


@dataclass
class PeerJob:
    """A job that joined its peers through this service (``JoinPeers``)."""

    job: str
    key: bytes
    root: RootKey
    replicas: int
    services: list[p.PeerService]
    ranks: set[int] = field(default_factory=set)
    """The job's ranks on this node (whose shares go to the peers)."""

    def names(self, ref: ReplicaRef) -> bool:
        """True if ``ref`` is a share of this job's root."""
        return ref.root == self.root.name and ref.options == options_digest(self.root.options)


class Replicas:
    """Shares held for other nodes, the jobs joined here, and what was sent. Event loop."""

    def __init__(self, keep: int, release: Callable[[MappedSegment], None]) -> None:
        self.keep = keep
        self.release = release
        self.service = secrets.token_hex(8)
        """This service's identity among a job's services."""
        self.held: dict[tuple[str, str], list[tuple[ReplicaRef, HeldCheckpoint]]] = {}
        self.jobs: dict[str, PeerJob] = {}
        self.sent = 0
        self.bytes_sent = 0
        self.pending = 0
        """Pushes not yet over (waiting for this node's saves, or under way)."""
        self.superseded = 0
        """Pushes dropped before they started: a newer step of the same rank was held."""
        self.fetched = 0
        self.failures: collections.Counter[str] = collections.Counter()
        self._warned: set[str] = set()

    def join(self, key: RootKey, message: p.JoinPeers) -> PeerJob:
        """Register (or extend with more local ranks) ``message``'s job for root ``key``.
        A root keeps two jobs at most, the newest that writes (``replicas`` > 0: its
        shares go out) and the newest that restores: each restore joins a job of its own,
        and an older one of the same kind is forgotten (its peers have joined the newer)."""
        job = self.jobs.get(message.job)
        if job is None or job.key != message.key or job.root != key:
            job = PeerJob(message.job, message.key, key, message.replicas, message.services)
            self.jobs.pop(message.job, None)
            self.jobs[message.job] = job  # the newest last
        job.ranks.update(message.ranks)
        job.replicas = max(job.replicas, message.replicas)
        job.services = message.services
        for older in [j for j in self.jobs.values() if j is not job and j.root == key]:
            if (older.replicas > 0) == (job.replicas > 0):
                del self.jobs[older.job]
                self._warned.discard(older.job)
        return job

    def job_for(self, key: RootKey, *, writing: bool = False) -> PeerJob | None:
        """The job joined last for root ``key`` (``writing``: the last whose shares go out,
        so a restore that joined since does not stop a writer's replicas)."""
        found = [
            job for job in self.jobs.values() if job.root == key and (job.replicas or not writing)
        ]
        return found[-1] if found else None

    def targets(self, job: PeerJob) -> list[p.PeerService]:
        """The services this node's shares of ``job`` go to (a warning, once, when the job
        has fewer other nodes than ``replicas``)."""
        chosen = ring(job.services, self.service, job.replicas)
        if len(chosen) < job.replicas and job.job not in self._warned:
            self._warned.add(job.job)
            _log.warning(
                "replicas=%d but job %s has %d other node(s): each share is held by %d",
                job.replicas,
                job.job,
                len(chosen),
                len(chosen),
            )
        return chosen

    def add(self, ref: ReplicaRef, held: HeldCheckpoint) -> None:
        """Hold ``held`` (a share another service sent): it replaces the same share, and
        steps older than the newest ``keep`` of its root go."""
        if self.keep <= 0:
            self.release(held.segment)
            self.failures["not kept (--keep-in-memory 0)"] += 1
            return
        kept: list[tuple[ReplicaRef, HeldCheckpoint]] = []
        for old_ref, old in self.held.get((ref.root, ref.options), []):
            if old_ref == ref:
                self.release(old.segment)
            else:
                kept.append((old_ref, old))
        kept.append((ref, held))
        kept.sort(key=lambda pair: pair[0].step)
        while len({r.step for r, _ in kept}) > self.keep:
            self.release(kept.pop(0)[1].segment)
        self.held[(ref.root, ref.options)] = kept

    def find(self, ref: ReplicaRef) -> HeldCheckpoint | None:
        """The replica ``ref`` names, if held."""
        for held_ref, held in self.held.get((ref.root, ref.options), []):
            if held_ref == ref:
                return held
        return None

    def evict_oldest(self) -> bool:
        """Drop the oldest replica of any root; False if none is held."""
        candidates = [(pairs[0][0].step, name) for name, pairs in self.held.items() if pairs]
        if not candidates:
            return False
        _, name = min(candidates)
        ref, held = self.held[name].pop(0)
        if not self.held[name]:
            del self.held[name]
        self.release(held.segment)
        self.failures["dropped for memory"] += 1
        _log.info(
            "dropped the replica of rank %d, step %d of %s for memory", ref.rank, ref.step, ref.root
        )
        return True

    @property
    def count(self) -> int:
        return sum(len(pairs) for pairs in self.held.values())

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for pairs in self.held.values() for _, h in pairs)

    def clear(self) -> None:
        for pairs in self.held.values():
            for _, held in pairs:
                self.release(held.segment)
        self.held.clear()


def own_share(tier: MemoryTier, ref: ReplicaRef) -> HeldCheckpoint | None:
    """This node's own held share that ``ref`` names (a peer fetching it), if any."""
    for key, held in tier.roots.items():
        if key.name != ref.root or options_digest(key.options) != ref.options:
            continue
        for copy in held:
            if copy.step == ref.step and copy.rank == ref.rank:
                return copy
    return None
