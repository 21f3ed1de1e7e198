"""One commit from many ranks: every rank writes its share, one rank publishes.

Runs on each rank's writer event loop; store calls and file I/O go to worker
threads. An attempt (the n-th of this writer at a step) has keys of its own in
the group's store (``s{step}a{n}/...``):

1. ``digest/{rank}``: each rank's digest of every component (CRC32C and size of
   the files the plan makes of it). A rank that does not post one within
   JOIN_SECONDS while alive did not join the save (``if rank == 0: save()``): the
   save fails naming it. Replicated components must agree on every rank; a
   mismatch fails the save naming the component and the ranks (every rank sees
   the same digests, so every rank raises the same error).
2. The files are spread over the ranks by size; each rank streams and commits
   its own (the single-process commit protocol), then posts ``files/{rank}``.
3. The publisher waits for every rank's files, publishes the one manifest, and
   posts ``outcome``; the others wait for it.

A rank that fails posts ``fail/{rank}`` (and bumps ``failed``); a rank whose
heartbeat stops is dead. Either way every rank fails with RankFailedError,
removes the files it committed, and nothing is published: a dead rank's files
are leftovers for ``gc``.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import msgspec

from checkpointd import tunables
from checkpointd._version import __version__
from checkpointd.catalog import read_manifest, step_path
from checkpointd.checksum import crc32c
from checkpointd.commit import (
    _clean_up,
    _sweep,
    in_thread,
    open_step,
    publish_manifest,
    write_files,
)
from checkpointd.distributed import Group, Liveness
from checkpointd.errors import CheckpointError, RankFailedError
from checkpointd.handle import first_leaf
from checkpointd.layout import step_dirname
from checkpointd.manifest import (
    CheckpointInfo,
    ComponentEntry,
    FileEntry,
    Manifest,
    ShardedTensor,
    schema_for,
    shard_problem,
)
from checkpointd.plan import PlannedFile, SavePlan, WriteFile
from checkpointd.retention import WriterIdentity
from checkpointd.storage import FileSink, Store

__all__ = ["assign_ranks", "commit_ranked", "component_digests"]

T = TypeVar("T")


def component_digests(plan: SavePlan) -> dict[str, list[int]]:
    """Per replicated component, [CRC32C, size] of the bytes of all its files, in plan
    order (per-rank components are not compared). Any thread."""
    digests: dict[str, list[int]] = {}
    for file in plan.files:
        if file.component in plan.per_rank or file.own:
            continue
        digest, size = digests.get(file.component, [0, 0])
        for part in file.parts:
            view = memoryview(part).cast("B")
            digest = crc32c(view, digest)
            size += view.nbytes
        digests[file.component] = [digest, size]
    return digests


def assign_ranks(
    files: list[PlannedFile], world_size: int, rank: int, per_rank: Mapping[str, str]
) -> list[WriteFile]:
    """``files`` with each one's writing rank: a per-rank component's and this rank's
    shard files to ``rank``; the replicated ones largest first to the least-loaded rank
    (lowest rank on ties), so every rank writes about the same number of bytes, the
    same on every rank."""
    loads = [0] * world_size
    ranked: dict[str, WriteFile] = {}
    for file in files:
        if file.component in per_rank or file.own:
            ranked[file.name] = WriteFile(file.name, file.parts, file.component, rank, own=True)
    shared = [f for f in files if f.component not in per_rank and not f.own]
    for file in sorted(shared, key=lambda f: (-f.size, f.name)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        loads[rank] += file.size
        ranked[file.name] = WriteFile(file.name, file.parts, file.component, rank)
    return [ranked[f.name] for f in files]


def _mismatch(step: int, posted: dict[int, dict[str, list[int]]]) -> str | None:
    """The message for replicas that disagree, or None if every rank's digests agree."""
    components = sorted({name for digests in posted.values() for name in digests})
    for name in components:
        groups: dict[str, list[int]] = {}
        for rank in sorted(posted):
            value = posted[rank].get(name)
            groups.setdefault(
                "missing" if value is None else f"{value[0]:08x}/{value[1]}", []
            ).append(rank)
        if len(groups) > 1:
            ranks = "; ".join(f"ranks {r} have {key}" for key, r in groups.items())
            return (
                f"the save of step {step} failed: component {name!r} differs between ranks "
                f"({ranks}, as crc32c/bytes); replicated components must be equal on every "
                "rank (wrap a per-rank component in checkpointd.PerRank)"
            )
    return None


class _Share(msgspec.Struct, frozen=True):
    """What a rank posts once its files are durable: their entries, and the components
    only it has (its per-rank ones) with the per-rank names they stand for."""

    files: list[FileEntry]
    components: dict[str, ComponentEntry]
    per_rank: dict[str, str]
    sharded: dict[str, dict[str, ShardedTensor]] = msgspec.field(default_factory=dict)
    """Per replicated component, its sharded tensors with the shards this rank wrote."""


def _lost_store(method: Callable[..., T]) -> Callable[..., T]:
    """Turn a failed store call (its host died: rank 0 or the launcher) into RankFailedError."""

    @functools.wraps(method)
    def call(self: _Attempt, *args: Any) -> T:
        try:
            return method(self, *args)
        except CheckpointError:
            raise
        except Exception as exc:
            raise RankFailedError(
                f"the save of step {self.step} failed: the job's store is unreachable "
                f"({type(exc).__name__}: {exc}); the rank that hosts it (rank 0 with "
                "tcp:// or env:// init) or the launcher is probably gone; nothing was published"
            ) from None

    return call


class _Attempt:
    """One rank's view of one attempt's keys. Blocking calls: run them in worker threads."""

    def __init__(self, group: Group, step: int, number: int) -> None:
        self.group = group
        self.step = step
        self.prefix = f"s{step}a{number}/"
        self.liveness = Liveness(group)

    @_lost_store
    def dead(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` whose heartbeat stopped."""
        return self.liveness.dead(ranks)

    @_lost_store
    def closed(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` that closed their writer."""
        return [r for r in ranks if self.group.closed(r)]

    @_lost_store
    def post(self, kind: str, value: Any) -> None:
        self.group.store.set(f"{self.prefix}{kind}/{self.group.rank}", msgspec.json.encode(value))

    def fail(self, message: str) -> None:
        """Tell every rank this one failed (best effort)."""
        with contextlib.suppress(Exception):
            self.group.store.set(f"{self.prefix}fail/{self.group.rank}", message.encode())
            self.group.store.add(f"{self.prefix}failed", 1)

    @_lost_store
    def check_failures(self) -> None:
        """Raise RankFailedError if another rank posted a failure."""
        if int(self.group.store.add(f"{self.prefix}failed", 0)) == 0:
            return
        for rank in range(self.group.world_size):
            key = f"{self.prefix}fail/{rank}"
            if rank != self.group.rank and self.group.store.check([key]):
                why = self.group.store.get(key).decode(errors="replace")
                raise RankFailedError(f"the save of step {self.step} failed on rank {rank}: {why}")

    @_lost_store
    def poll(self, kind: str, ranks: list[int]) -> dict[int, bytes]:
        """The values of ``kind`` that ``ranks`` posted so far."""
        found = {}
        for rank in ranks:
            key = f"{self.prefix}{kind}/{rank}"
            if self.group.store.check([key]):
                found[rank] = self.group.store.get(key)
        return found


async def _gather(
    attempt: _Attempt, kind: str, ranks: list[int], *, join: bool
) -> dict[int, bytes]:
    """Wait until every rank of ``ranks`` posted ``kind``; fail on a posted failure, a dead
    rank, or (``join``) a live rank that has not posted within JOIN_SECONDS."""
    got: dict[int, bytes] = {}
    started = time.monotonic()
    pause = tunables.POLL_SECONDS / 16
    while True:
        missing = [r for r in ranks if r not in got]
        got.update(await anyio.to_thread.run_sync(attempt.poll, kind, missing))
        missing = [r for r in ranks if r not in got]
        if not missing:
            return got
        await anyio.to_thread.run_sync(attempt.check_failures)
        closed = await anyio.to_thread.run_sync(attempt.closed, missing)
        if closed:
            raise RankFailedError(
                f"the save of step {attempt.step} failed: rank(s) {closed} closed their writer "
                "without taking part in it; nothing was published"
            )
        dead = await anyio.to_thread.run_sync(attempt.dead, missing)
        if dead:
            raise RankFailedError(
                f"the save of step {attempt.step} failed: rank(s) {dead} stopped responding "
                f"(no heartbeat for {tunables.STALE_SECONDS}s); nothing was published"
            )
        if join and time.monotonic() - started > tunables.JOIN_SECONDS:
            raise RankFailedError(
                f"the save of step {attempt.step} failed: rank(s) {missing} did not join it "
                f"within {tunables.JOIN_SECONDS}s; every rank must call save({attempt.step}) "
                "(to save from one process alone, make its writer with "
                "process_group=checkpointd.LOCAL)"
            )
        await anyio.sleep(pause)
        pause = min(pause * 2, tunables.POLL_SECONDS)  # quick when the others are close


async def commit_ranked(
    store: Store,
    plan: SavePlan,
    limiter: anyio.CapacityLimiter,
    group: Group,
    number: int,
    *,
    identity: WriterIdentity | None = None,
) -> CheckpointInfo:
    """This rank's part of the collective commit of ``plan`` (attempt ``number`` at its
    step); returns the CheckpointInfo once the publisher published the manifest.

    Raises RankFailedError if another rank failed, died or did not join, or replicas
    differ; this rank's own error (posted to the others first) if it failed here.
    """
    attempt = _Attempt(group, plan.step, number)
    streamed: list[tuple[FileSink, FileEntry]] = []
    committed: list[FileEntry] = []
    everyone = list(range(group.world_size))
    try:
        digests = await anyio.to_thread.run_sync(component_digests, plan)
        await anyio.to_thread.run_sync(attempt.post, "digest", digests)
        posted = await _gather(attempt, "digest", everyone, join=True)
        message = _mismatch(
            plan.step,
            {r: msgspec.json.decode(v, type=dict[str, list[int]]) for r, v in posted.items()},
        )
        if message is not None:
            raise RankFailedError(message)
        await _write_share(store, plan, limiter, attempt, streamed=streamed, committed=committed)
        if group.publishes:
            manifest = await _publish(store, plan, limiter, attempt, identity=identity)
            await anyio.to_thread.run_sync(attempt.post, "outcome", "ok")
        else:
            await _gather(attempt, "outcome", [group.publisher], join=False)
            manifest = await in_thread(limiter, read_manifest, store, plan.step)
    except BaseException as exc:
        leaf = first_leaf(exc)
        with anyio.CancelScope(shield=True):
            if not isinstance(leaf, RankFailedError):
                what = f"{type(leaf).__name__}: {leaf}"
                await anyio.to_thread.run_sync(attempt.fail, what)
            await in_thread(limiter, _clean_up, store, plan.step, streamed, committed)
        if isinstance(exc, Exception) and leaf is not exc:
            raise leaf from None
        raise
    if group.publishes:
        if identity is not None:
            identity.note_commit(time.monotonic())
        listed = [f.path for f in manifest.files]
        with anyio.CancelScope(shield=True):
            with contextlib.suppress(Exception):
                await in_thread(limiter, _sweep, store, step_dirname(plan.step), listed)
    return CheckpointInfo.from_manifest(manifest, step_path(store, plan.step))


async def _write_share(
    store: Store,
    plan: SavePlan,
    limiter: anyio.CapacityLimiter,
    attempt: _Attempt,
    *,
    streamed: list[tuple[FileSink, FileEntry]],
    committed: list[FileEntry],
) -> None:
    """Stream and commit the files assigned to this rank, then post their entries
    (``streamed``/``committed`` collect them, for the clean-up on failure)."""
    group = attempt.group
    await open_step(store, plan.step, limiter)
    assigned = assign_ranks(plan.files, group.world_size, group.rank, plan.per_rank)
    mine = [f for f in assigned if f.rank == group.rank]
    await write_files(store, plan.step, mine, limiter, streamed=streamed, committed=committed)
    own = {key: plan.components[key] for key in plan.per_rank}
    sharded = {
        name: entry.sharded
        for name, entry in plan.components.items()
        if entry.sharded and name not in plan.per_rank
    }
    share = _Share(committed, own, plan.per_rank, sharded)
    await anyio.to_thread.run_sync(attempt.post, "files", share)


def _merge_shards(
    step: int, name: str, entry: ComponentEntry, shares: list[_Share]
) -> ComponentEntry:
    """``entry`` with the shards every rank wrote of its sharded tensors; raises
    RankFailedError unless they tile each tensor exactly (ranks that disagree on a
    DTensor's shape or placements)."""
    if not entry.sharded:
        return entry
    merged: dict[str, ShardedTensor] = {}
    for tensor, mine in entry.sharded.items():
        shards = []
        for share in shares:
            theirs = share.sharded.get(name, {}).get(tensor)
            if theirs is None or (theirs.dtype, theirs.shape) != (mine.dtype, mine.shape):
                raise RankFailedError(
                    f"the save of step {step} failed: ranks disagree on DTensor "
                    f"{name}/{tensor} (its dtype and global shape must be the same on every rank)"
                )
            shards += theirs.shards
        merged[tensor] = ShardedTensor(mine.dtype, mine.shape, shards)
        if problem := shard_problem(merged[tensor]):
            raise RankFailedError(
                f"the save of step {step} failed: the shards of DTensor {name}/{tensor} do not "
                f"tile it ({problem}); every rank must save the same DTensors"
            )
    return msgspec.structs.replace(entry, sharded=merged)


async def _publish(
    store: Store,
    plan: SavePlan,
    limiter: anyio.CapacityLimiter,
    attempt: _Attempt,
    *,
    identity: WriterIdentity | None,
) -> Manifest:
    """Wait for every rank's files, then publish the manifest listing all of them."""
    group = attempt.group
    posted = await _gather(attempt, "files", list(range(group.world_size)), join=False)
    shares = [msgspec.json.decode(posted[r], type=_Share) for r in sorted(posted)]
    files = [entry for share in shares for entry in share.files]
    components = {
        name: _merge_shards(plan.step, name, entry, shares)
        for name, entry in plan.components.items()
        if name not in plan.per_rank
    }
    per_rank: dict[str, list[str]] = {}
    for share in shares:
        components.update(share.components)
        for key, name in share.per_rank.items():
            per_rank.setdefault(name, []).append(key)
    manifest = Manifest(
        schema_version=schema_for(components),
        step=plan.step,
        created_at=plan.created_at,
        library_version=__version__,
        components=components,
        files=sorted(files, key=lambda f: f.path),
        metrics=plan.metrics,
        metadata=plan.metadata,
        world_size=group.world_size,
        per_rank=per_rank,
        specs=plan.specs,
        writer="" if identity is None else identity.id,
        lineage="" if identity is None else identity.lineage,
    )
    await publish_manifest(store, manifest, limiter)
    return manifest
