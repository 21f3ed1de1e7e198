"""A many-rank save whose service went away while the trainer lives: follow its one outcome.

The other ranks' services may have committed the attempt (this rank's share was
durable and posted before its service died) or may abandon it. The trainer
proposes ``abandoned`` like any rank that gives up (ranks/attempt.py) and
reports whichever outcome holds, so its handle agrees with every other rank's.
Blocking; a thread of its own (remote.py). Imports no torch itself.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from checkpointd import tunables
from checkpointd.errors import CheckpointError, RankFailedError, ServiceError
from checkpointd.format.manifest import CheckpointInfo
from checkpointd.ranks.attempt import COMMITTED, FAILED, OK, Attempt
from checkpointd.ranks.group import Group
from checkpointd.read.catalog import read_manifest, step_path
from checkpointd.storage import open_store

__all__ = ["outcome_after_loss"]


def outcome_after_loss(  # noqa: PLR0917 - remote.py's one call
    group: Group,
    root: str,
    storage_options: Mapping[str, Any] | None,
    step: int,
    attempt: int,
    error: ServiceError,
) -> tuple[CheckpointInfo | None, CheckpointError | None]:
    """(info, None) if the attempt committed and was published, else (None, why)."""
    state = Attempt(group, step, attempt)
    try:
        outcome = state.give_up(f"its checkpoint service went away ({error})")
        if outcome != COMMITTED:
            state.raise_if_abandoned(outcome)
        wait = tunables.PUBLISH_WAIT_SECONDS
        deadline = time.monotonic() + wait
        while (published := state.read("published")) is None:
            if time.monotonic() > deadline:
                return None, ServiceError(
                    f"{error}; step {step} was committed by the ranks but not published "
                    f"within {wait:g}s: list_checkpoints tells whether it is"
                )
            time.sleep(tunables.POLL_SECONDS * 4)
    except RankFailedError as exc:  # abandoned, or the job's store is gone
        return None, exc
    if published != OK:
        why = published[len(FAILED) :].decode(errors="replace")
        return None, RankFailedError(f"the save of step {step} failed: its publish failed ({why})")
    store = open_store(root, storage_options)
    try:
        return CheckpointInfo.from_manifest(
            read_manifest(store, step), step_path(store, step)
        ), None
    except CheckpointError as exc:
        return None, exc
    finally:
        store.close()
