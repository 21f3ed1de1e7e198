"""One attempt at a many-rank save: its keys in the group's store, and its one outcome.

An attempt (the n-th of a writer at a step, numbered the same on every rank) has
keys of its own under ``s{step}a{n}/``. Its outcome is decided once, by a
compare-and-set of the ``outcome`` key from absent to one of two values:

- ``committed``: the publisher saw every rank's files durable and posted the
  manifest it will publish (key ``manifest``); from then on no rank removes a
  file, and ``published`` ("ok", or "failed: why" if the publish failed) tells
  every rank how it ended. If the publisher dies before saying, a follower
  publishes the posted manifest itself (the same bytes, an exclusive create).
- ``abandoned: why``: a rank gave up (a failure, a dead or absent peer, a refused
  ``save()``); nothing is published and every rank removes its own files.

The publisher must win ``committed`` before it publishes; a rank that gives up
must win ``abandoned`` before it deletes or reports. A rank that loses follows
the winner, so every rank's handle reports the same outcome, also a rank that
was stopped (SIGSTOP, a VM pause) and resumes late. Blocking calls: worker
threads (the caller thread for ``abandon``).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import msgspec

from checkpointd import tunables
from checkpointd.errors import CheckpointError, RankFailedError
from checkpointd.ranks import values
from checkpointd.ranks.group import Group, Liveness

__all__ = [
    "COMMITTED",
    "FAILED",
    "OK",
    "Attempt",
    "abandon",
    "gather",
    "reason_to_give_up",
    "wait_for",
]

T = TypeVar("T")

COMMITTED = b"committed"
_ABANDONED = b"abandoned: "
OK = b"ok"
"""``published``: the manifest of a committed attempt is on storage."""
FAILED = b"failed: "
"""``published``: its publish failed (followed by why); every rank fails."""


def _lost_store(method: Callable[..., T]) -> Callable[..., T]:
    """Turn a failed store call (its host died: rank 0 or the launcher) into
    RankFailedError."""

    @functools.wraps(method)
    def call(self: Attempt, *args: Any) -> T:
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


class Attempt:
    """One rank's view of one attempt's keys. Blocking calls: run them in worker threads."""

    def __init__(self, group: Group, step: int, number: int) -> None:
        self.group = group
        self.step = step
        self.number = number
        self.prefix = f"s{step}a{number}/"
        self.liveness = Liveness(group)

    def _key(self, name: str) -> str:
        return f"{self.prefix}{name}"

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
        """Post this rank's ``kind`` (msgspec JSON)."""
        values.put(
            self.group.store, self._key(f"{kind}/{self.group.rank}"), msgspec.json.encode(value)
        )

    def poll(self, kind: str, ranks: list[int]) -> dict[int, bytes]:
        """The values of ``kind`` that ``ranks`` posted so far."""
        posted = {rank: self.read(f"{kind}/{rank}") for rank in ranks}
        return {rank: value for rank, value in posted.items() if value is not None}

    def decide(self, outcome: bytes) -> bytes:
        """Propose ``outcome``; return the one that holds (ours if we were first)."""
        return self.set_once("outcome", outcome)

    def give_up(self, why: str) -> bytes:
        """Propose ``abandoned`` for ``why`` (prefixed with this rank); the outcome that holds."""
        return self.decide(_ABANDONED + f"{self.group.name(self.group.rank)}: {why}".encode())

    def outcome(self) -> bytes | None:
        """The decided outcome, or None while undecided."""
        return self.read("outcome")

    @_lost_store
    def set_once(self, name: str, value: bytes) -> bytes:
        """Set key ``name`` unless set; the value that holds."""
        return values.put(self.group.store, self._key(name), value, once=True)

    @_lost_store
    def wait(self, name: str, seconds: float) -> bytes | None:
        """Key ``name``'s value once it is set, blocking in the store's ``wait`` for at most
        ``seconds``; None if it is still unset then."""
        self.group.wait(self._key(name), seconds)
        return self.read(name)

    @_lost_store
    def read(self, name: str) -> bytes | None:
        """Key ``name``'s value, or None if it is not set."""
        key = self._key(name)
        return values.get(self.group.store, key) if self.group.store.check([key]) else None

    def raise_if_abandoned(self, outcome: bytes | None = None) -> None:
        """RankFailedError with the winner's reason if the attempt was abandoned."""
        outcome = self.outcome() if outcome is None else outcome
        if outcome is not None and outcome.startswith(_ABANDONED):
            why = outcome[len(_ABANDONED) :].decode(errors="replace")
            raise RankFailedError(
                f"the save of step {self.step} failed on {why}; nothing was published"
            )


def abandon(group: Group, step: int, number: int, why: str) -> None:
    """Abandon attempt ``number`` at ``step`` before it started here (a ``save()`` this
    rank refused), so the other ranks fail at once instead of waiting for it to join.
    Best effort; caller thread."""
    with contextlib.suppress(CheckpointError):  # the store is gone: the others fail on that
        Attempt(group, step, number).give_up(why)


async def gather(attempt: Attempt, kind: str, ranks: list[int], *, join: bool) -> dict[int, bytes]:
    """Wait until every rank of ``ranks`` posted ``kind``.

    Raises RankFailedError once the attempt is abandoned (by anyone), and abandons it
    first for a rank that closed its writer, a dead rank, or (``join``) a live rank
    that has not posted within the group's ``join_seconds``. Only for posts that precede the commit
    (digests, files), so giving up cannot lose to ``committed``. Event loop.
    """
    got: dict[int, bytes] = {}
    started = time.monotonic()
    pause = tunables.POLL_SECONDS / 16
    while True:
        missing = [r for r in ranks if r not in got]
        got.update(await anyio.to_thread.run_sync(attempt.poll, kind, missing))
        missing = [r for r in ranks if r not in got]
        if not missing:
            return got
        attempt.raise_if_abandoned(await anyio.to_thread.run_sync(attempt.outcome))
        why = await reason_to_give_up(attempt, missing, since=started if join else None)
        if why is not None:
            attempt.raise_if_abandoned(await anyio.to_thread.run_sync(attempt.give_up, why))
            # Unreachable while the protocol holds: a commit needs every rank's posts.
            raise RankFailedError(f"the save of step {attempt.step} committed without {kind}")
        await anyio.sleep(pause)
        pause = min(pause * 2, tunables.POLL_SECONDS)  # quick when the others are close


async def reason_to_give_up(
    attempt: Attempt, missing: list[int], *, since: float | None
) -> str | None:
    """Why this rank gives up waiting for ``missing`` (closed, dead, or, with ``since``,
    absent for the group's ``join_seconds`` since then), or None to keep waiting. Event loop."""
    named = attempt.group.named
    closed = await anyio.to_thread.run_sync(attempt.closed, missing)
    if closed:
        return f"{named(closed)} closed their writer without taking part in it"
    dead = await anyio.to_thread.run_sync(attempt.dead, missing)
    if dead:
        return f"{named(dead)} stopped responding (no heartbeat for {tunables.STALE_SECONDS}s)"
    join_seconds = attempt.group.join_seconds
    if since is not None and time.monotonic() - since > join_seconds:
        return (
            f"{named(missing)} did not join it within {join_seconds}s; every rank "
            f"of the group must call save({attempt.step}) (to save from one process alone, "
            "make its writer with process_group=checkpointd.LOCAL)"
        )
    return None


async def wait_for(
    attempt: Attempt, name: str, ranks: list[int], *, give_up: bool = True
) -> bytes | None:
    """Wait until key ``name`` of ``attempt`` has a value: blocked in the store's ``wait``
    (no polling, whatever the world size), looking at ``ranks``' heartbeats every
    tunables.WAIT_SECONDS (at most a third of STALE_SECONDS). If ``ranks`` die or close
    first: with ``give_up`` (the outcome only), propose ``abandoned``, which sets the
    outcome and so ends the wait, and return the outcome that holds; else None (after
    one last look). Event loop (a cancelled wait leaves its thread to end at its
    timeout)."""
    look = min(tunables.WAIT_SECONDS, tunables.STALE_SECONDS / 3)
    if not give_up:
        return await _wait_looking(attempt, name, ranks, look)
    assert name == "outcome", name  # giving up sets the outcome: only that wait ends
    failures: list[Exception] = []
    value: bytes | None = None
    async with anyio.create_task_group() as tasks:

        async def abandon_if_gone() -> None:
            try:
                while True:
                    await anyio.sleep(look)
                    why = await reason_to_give_up(attempt, ranks, since=None)
                    if why is not None:
                        await anyio.to_thread.run_sync(attempt.give_up, why)
                        return
            except Exception as exc:  # the store lost: raised below, as it is
                failures.append(exc)
                tasks.cancel_scope.cancel()

        tasks.start_soon(abandon_if_gone)
        wait = functools.partial(attempt.wait, name, tunables.OUTCOME_WAIT_SECONDS)
        try:
            while value is None:
                value = await anyio.to_thread.run_sync(wait, abandon_on_cancel=True)
        except Exception as exc:  # raised as it is, not as an exception group
            failures.append(exc)
        tasks.cancel_scope.cancel()
    if failures:
        raise failures[0]
    return value


async def _wait_looking(attempt: Attempt, name: str, ranks: list[int], look: float) -> bytes | None:
    """``wait_for`` without giving up: waits of ``look`` seconds, the heartbeats of
    ``ranks`` looked at between two; None (after one last look) once they are gone."""
    wait = functools.partial(attempt.wait, name, look)
    while True:
        value = await anyio.to_thread.run_sync(wait, abandon_on_cancel=True)
        if value is not None:
            return value
        if await reason_to_give_up(attempt, ranks, since=None) is not None:
            return await anyio.to_thread.run_sync(attempt.read, name)  # one last look
