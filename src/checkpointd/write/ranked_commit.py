"""One commit from many ranks: every rank writes its share, one rank publishes.

Runs on each rank's writer event loop; store calls and file I/O go to worker
threads. The attempt's keys and its one outcome are attempt.py's:

1. ``digest/{rank}``: each rank's digest of every component (CRC32C and size of
   the files the plan makes of it). The publisher reads them all; a rank that
   does not post one within the writer's join_seconds
   while alive did not join the save
   (``if rank == 0: save()``). Replicated components must agree on every rank; a
   mismatch abandons the save naming the component and the ranks. Once they
   agree the publisher posts ``joined/{publisher}``, which the others wait for
   (on the publisher alone, so a rank's reads stay the same for any world size).
2. The files are spread over the ranks by size; each rank streams and commits
   its own (the single-process commit protocol), then posts ``files/{rank}``.
3. The publisher waits for every rank's files, posts the manifest and its
   ``summary`` (what a CheckpointInfo needs), wins the ``committed`` outcome,
   publishes and posts ``published``; the others wait for the outcome, and for
   ``published``, then read the summary (and the manifest only to publish it
   themselves if the publisher dies first).

Whoever gives up (a failure, a dead, closed or absent rank) must win
``abandoned`` first; then every rank removes the files it committed and
nothing is published. A dead rank's files are leftovers for ``gc``.
"""

from __future__ import annotations

import contextlib
import logging

import anyio
import anyio.to_thread
import msgspec

from checkpointd.errors import CheckpointExistsError, RankFailedError
from checkpointd.format.checksum import crc32c
from checkpointd.format.layout import MANIFEST_NAME, step_dirname
from checkpointd.format.manifest import (
    BlobEntry,
    CheckpointInfo,
    FileEntry,
    Manifest,
    decode_manifest,
    encode_manifest,
)
from checkpointd.maintain.retention import WriterIdentity
from checkpointd.ranks.attempt import (
    COMMITTED,
    FAILED,
    OK,
    Attempt,
    gather,
    wait_for,
)
from checkpointd.ranks.group import Group
from checkpointd.read.catalog import read_manifest, step_path
from checkpointd.storage import FileSink, Store
from checkpointd.storage.base import shown
from checkpointd.write.commit import (
    clean_up,
    finish_commit,
    in_thread,
    info_of,
    open_step,
    publish_manifest,
    write_files,
)
from checkpointd.write.handle import first_leaf
from checkpointd.write.items import WriteFile
from checkpointd.write.plan import SavePlan
from checkpointd.write.ranked_merge import (
    Share,
    Summary,
    indexed,
    indexed_share,
    merged_manifest,
    shard_index,
    written_shards,
)

__all__ = ["commit_ranked", "component_digests"]

_log = logging.getLogger(__name__)


def component_digests(plan: SavePlan) -> dict[str, list[int]]:
    """Per replicated component, [CRC32C, size] of the bytes of all its files, in plan
    order, and of the blobs its tensors refer to (by name: the name is their digest);
    per-rank components and shards are not compared. Any thread."""
    digests: dict[str, list[int]] = {}
    for file in plan.files:
        if not isinstance(file, WriteFile):
            continue
        digest, size = digests.get(file.component, [0, 0])
        for part in file.parts:
            view = memoryview(part).cast("B")
            digest = crc32c(view, digest)
            size += view.nbytes
        digests[file.component] = [digest, size]
    for name, entry in plan.components.items():
        if entry.refs and name not in plan.per_rank:
            digest, size = digests.get(name, [0, 0])
            digests[name] = [crc32c(msgspec.json.encode(entry.refs), digest), size]
    return digests


def _mismatch(posted: dict[int, dict[str, list[int]]]) -> str | None:
    """Why replicas disagree, or None if every rank's digests agree."""
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
                f"component {name!r} differs between ranks "
                f"({ranks}, as crc32c/bytes); replicated components must be equal on every "
                "rank (wrap a per-rank component in checkpointd.PerRank)"
            )
    return None


async def commit_ranked(
    store: Store,
    plan: SavePlan,
    limiter: anyio.CapacityLimiter,
    group: Group,
    number: int,
    *,
    identity: WriterIdentity | None = None,
    chunk_bytes: int,
    written: list[FileEntry] | None = None,
) -> CheckpointInfo:
    """This rank's part of the collective commit of ``plan`` (attempt ``number`` at its
    step); returns the CheckpointInfo once the manifest is published, having added to
    ``written`` (if given) the entries of the files this rank wrote (their sizes and
    CRC32Cs as committed).

    Raises RankFailedError if the attempt was abandoned (another rank failed, died or
    did not join, or replicas differ); this rank's own error if it failed here (after
    abandoning the attempt for every rank). The same outcome on every rank.
    """
    attempt = Attempt(group, plan.step, number)
    streamed: list[tuple[FileSink, FileEntry]] = []
    committed: list[FileEntry] = []
    try:
        digests = await anyio.to_thread.run_sync(component_digests, plan)
        await anyio.to_thread.run_sync(attempt.post, "digest", digests)
        await _join(attempt)
        _log.debug("step %d: rank %d joined attempt %d", plan.step, group.rank, number)
        await _write_share(
            store,
            plan,
            limiter,
            attempt,
            streamed=streamed,
            committed=committed,
            chunk_bytes=chunk_bytes,
        )
        _log.debug("step %d: rank %d wrote its %d files", plan.step, group.rank, len(committed))
        if group.publishes:
            manifest = await _publish(store, plan, limiter, attempt, identity=identity)
            _log.debug("step %d: published the manifest of %d ranks", plan.step, group.world_size)
        else:
            info = await _follow(store, plan, limiter, attempt)
            if written is not None:
                written.extend(committed)
            return info
    except BaseException as exc:
        leaf = first_leaf(exc)
        why = shown(f"{type(leaf).__name__}: {leaf}")
        _log.debug("step %d: rank %d leaves attempt %d (%s)", plan.step, group.rank, number, why)
        with anyio.CancelScope(shield=True):
            if await _may_remove(attempt, leaf):
                await in_thread(limiter, clean_up, store, plan.step, streamed, committed)
            else:
                for sink, _ in streamed:
                    with contextlib.suppress(Exception):
                        sink.discard()
        if isinstance(exc, Exception) and leaf is not exc:
            raise leaf from None
        raise
    await finish_commit(store, manifest, limiter, identity=identity)
    if written is not None:
        written.extend(committed)
    return info_of(store, manifest)


async def _join(attempt: Attempt) -> None:
    """The publisher waits for every rank's digests, compares them and posts ``joined``;
    the others wait for that (RankFailedError once the attempt is abandoned)."""
    group = attempt.group
    if not group.publishes:
        # The publisher's own digest says it joined; whether the others did is its call.
        await gather(attempt, "digest", [group.publisher], join=True)
        await gather(attempt, "joined", [group.publisher], join=False)
        return
    posted = await gather(attempt, "digest", list(range(group.world_size)), join=True)
    why = _mismatch(
        {r: msgspec.json.decode(v, type=dict[str, list[int]]) for r, v in posted.items()},
    )
    if why is not None:
        attempt.raise_if_abandoned(await anyio.to_thread.run_sync(attempt.give_up, why))
    await anyio.to_thread.run_sync(attempt.post, "joined", 1)


async def _may_remove(attempt: Attempt, error: BaseException) -> bool:
    """After ``error`` here: abandon the attempt unless that is decided already; True
    if this rank may remove its files (the attempt is abandoned, or failed to publish),
    False if a commit holds or the outcome is unknown (keep them: a manifest may list
    them). Shielded, from commit_ranked's failure path."""
    why = f"{type(error).__name__}: {error}"
    try:
        outcome = await anyio.to_thread.run_sync(attempt.give_up, why)
        if outcome != COMMITTED:
            return True
        published = await anyio.to_thread.run_sync(attempt.read, "published")
    except RankFailedError:
        return False  # the store is gone: the outcome is unknown, gc decides later
    return (published or b"").startswith(FAILED)


async def _write_share(
    store: Store,
    plan: SavePlan,
    limiter: anyio.CapacityLimiter,
    attempt: Attempt,
    *,
    streamed: list[tuple[FileSink, FileEntry]],
    committed: list[FileEntry],
    chunk_bytes: int,
) -> None:
    """Stream and commit the files assigned to this rank, then post their entries
    (``streamed``/``committed`` collect them, for the clean-up on failure)."""
    group = attempt.group
    attempt.raise_if_abandoned(await anyio.to_thread.run_sync(attempt.outcome))
    await open_step(store, plan.step, limiter)
    blobs: dict[str, BlobEntry] = {}
    sharded = written_shards(plan.components, plan.per_rank)
    index = shard_index(plan, group, attempt.number, sharded)
    await write_files(
        store,
        plan.step,
        plan.mine(group.rank) + ([] if index is None else [index]),
        limiter,
        streamed=streamed,
        committed=committed,
        chunk_bytes=chunk_bytes,
        blobs=blobs,
    )
    own = {key: plan.components[key] for key in plan.per_rank}
    share = Share(committed, own, plan.per_rank, sharded, list(blobs.values()))
    if indexed(plan, group.world_size):  # the entries are in the index: post their checks
        share = indexed_share(share, plan, "" if index is None else index.name)
    await anyio.to_thread.run_sync(attempt.post, "files", share)


async def _publish(
    store: Store,
    plan: SavePlan,
    limiter: anyio.CapacityLimiter,
    attempt: Attempt,
    *,
    identity: WriterIdentity | None,
) -> Manifest:
    """The publisher: wait for every rank's files, post the manifest listing them, win
    ``committed``, publish it, post ``published``. Raises RankFailedError if the attempt
    was abandoned first (nothing published); the publish's error after posting it."""
    group = attempt.group
    posted = await gather(attempt, "files", list(range(group.world_size)), join=False)
    shares = [msgspec.json.decode(posted[r], type=Share) for r in sorted(posted)]
    manifest = merged_manifest(plan, group.world_size, shares, identity)
    await anyio.to_thread.run_sync(attempt.set_once, "manifest", encode_manifest(manifest))
    summary = msgspec.json.encode(Summary.of(manifest))
    await anyio.to_thread.run_sync(attempt.set_once, "summary", summary)
    attempt.raise_if_abandoned(await anyio.to_thread.run_sync(attempt.decide, COMMITTED))
    try:
        await _publish_once(store, manifest, limiter)
    except Exception as exc:
        failed = FAILED + f"{type(exc).__name__}: {exc}".encode()
        if await anyio.to_thread.run_sync(attempt.set_once, "published", failed) == OK:
            return manifest  # a follower published it meanwhile (this rank was stalled)
        raise
    await _settle(store, limiter, attempt, manifest)
    return manifest


async def _follow(
    store: Store, plan: SavePlan, limiter: anyio.CapacityLimiter, attempt: Attempt
) -> CheckpointInfo:
    """A rank that does not publish: wait for the outcome, then for ``published``; if the
    publisher dies in between, publish the posted manifest in its place. Returns the
    CheckpointInfo (from the publisher's summary: the manifest, as large as the job, is
    read only to stand in); RankFailedError if the attempt was abandoned or its publish
    failed."""
    publisher = [attempt.group.publisher]
    outcome = await wait_for(attempt, "outcome", publisher)
    attempt.raise_if_abandoned(outcome)
    published = await wait_for(attempt, "published", publisher, give_up=False)
    if published is None:  # the publisher died after the commit was decided
        posted = await anyio.to_thread.run_sync(attempt.read, "manifest")
        assert posted is not None  # posted before committed was proposed
        manifest = decode_manifest(posted, where=f"the posted manifest of step {attempt.step}")
        await _publish_once(store, manifest, limiter)
        await _settle(store, limiter, attempt, manifest)
        return CheckpointInfo.from_manifest(manifest, step_path(store, plan.step))
    if published.startswith(FAILED):
        why = published[len(FAILED) :].decode(errors="replace")
        raise RankFailedError(
            f"the save of step {attempt.step} failed: rank {attempt.group.publisher} could "
            f"not publish its manifest ({why})"
        )
    posted = await anyio.to_thread.run_sync(attempt.read, "summary")
    assert posted is not None  # posted before committed was proposed
    summary = msgspec.json.decode(posted, type=Summary)
    return summary.at(step_path(store, plan.step), attempt.group.world_size)


async def _publish_once(store: Store, manifest: Manifest, limiter: anyio.CapacityLimiter) -> None:
    """Publish ``manifest``; if one is there already, it must be this very manifest (a
    stalled publisher and the follower that stood in for it publish the same bytes)."""
    try:
        await publish_manifest(store, manifest, limiter)
    except CheckpointExistsError:
        if await in_thread(limiter, read_manifest, store, manifest.step) != manifest:
            raise


async def _settle(
    store: Store, limiter: anyio.CapacityLimiter, attempt: Attempt, manifest: Manifest
) -> None:
    """After this rank published ``manifest``: post ``published``. Should a stalled
    publisher have posted that its publish failed first, withdraw ours (manifest first,
    the deletion rule) and fail like every other rank."""
    held = await anyio.to_thread.run_sync(attempt.set_once, "published", OK)
    if held != OK:
        path = f"{step_dirname(manifest.step)}/{MANIFEST_NAME}"
        await in_thread(limiter, store.remove_file, path)
        raise RankFailedError(
            f"the save of step {attempt.step} failed: its publish failed on another rank "
            f"({held[len(FAILED) :].decode(errors='replace')})"
        )
