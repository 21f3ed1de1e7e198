"""Two writers saving the same steps into one root, concurrently, many rounds.

Exactly one wins each step; the loser gets CheckpointExistsError; the committed
checkpoint is entirely the winner's (never a mix, never overwritten later), and
once the loser's save has failed none of its files remain in the step folder.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest
import torch

import checkpointd
from checkpointd.errors import CheckpointExistsError
from checkpointd.format.manifest import MANIFEST_NAME, step_dirname
from checkpointd.read.catalog import read_manifest
from checkpointd.storage import open_store
from tests.conftest import Root
from tests.faults.helpers import same


def _state(writer: int, step: int, size: int) -> dict[str, Any]:
    return {
        "model": {"w": torch.full((size,), float(writer * 1000 + step))},
        "meta": {"writer": writer, "step": step},
    }


def _race(root: Root, rounds: int) -> dict[str, int]:
    writers = [
        checkpointd.CheckpointWriter(root.url, storage_options=root.storage_options)
        for _ in range(2)
    ]
    wins = {"0": 0, "1": 0}
    store = open_store(root.url, root.storage_options)
    try:
        for step in range(1, rounds + 1):
            # Different sizes so the writers' phases shift against each other round by round.
            sizes = [64 + 997 * (step % 5), 64 + 1499 * ((step + 2) % 7)]
            outcomes: list[Any] = [None, None]
            start = threading.Barrier(2)

            def run(
                i: int,
                step: int = step,
                sizes: list[int] = sizes,
                outcomes: list[Any] = outcomes,
                start: threading.Barrier = start,
            ) -> None:
                start.wait()
                try:
                    outcomes[i] = writers[i].save(step, _state(i, step, sizes[i])).result()
                except Exception as exc:
                    outcomes[i] = exc

            threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            winners = [i for i in range(2) if isinstance(outcomes[i], checkpointd.CheckpointInfo)]
            losers = [i for i in range(2) if i not in winners]
            assert len(winners) == 1, f"step {step}: outcomes {outcomes}"
            assert isinstance(outcomes[losers[0]], CheckpointExistsError), outcomes
            winner = winners[0]
            wins[str(winner)] += 1
            loaded = checkpointd.load(root.url, step, storage_options=root.storage_options)
            assert same(loaded.state, _state(winner, step, sizes[winner])), f"step {step} mixed"
            listed = {f.path for f in read_manifest(store, step).files}
            left = set(store.list_dir(step_dirname(step))) - {MANIFEST_NAME}
            assert left == listed, f"step {step}: the loser left {sorted(left - listed)}"
        # Nothing a loser did later damaged an earlier winner.
        for info in checkpointd.list_checkpoints(root.url, storage_options=root.storage_options):
            checkpointd.load(root.url, info.step, storage_options=root.storage_options)
    finally:
        store.close()
        for w in writers:
            with contextlib.suppress(CheckpointExistsError):
                w.close()  # the loser's failure was checked above
    return wins


def test_two_writers_local(local_root: Root) -> None:
    _race(local_root, rounds=40)


@pytest.mark.timeout(120)
def test_two_writers_s3(s3_root: Root) -> None:
    _race(s3_root, rounds=4)


@pytest.mark.timeout(120)
def test_two_writers_gcs(gcs_root: Root) -> None:
    """fake-gcs-server honours ifGenerationMatch=0: exactly one writer wins each step."""
    _race(gcs_root, rounds=4)


@pytest.mark.timeout(120)
def test_two_writers_azure(azure_root: Root) -> None:
    """Azurite honours If-None-Match: *: exactly one writer wins each step."""
    _race(azure_root, rounds=4)
