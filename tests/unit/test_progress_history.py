"""TrainingProgress.history is bounded, so a save's blocked time does not grow with the run."""

from __future__ import annotations

from pathlib import Path

import pytest

import checkpointd
from checkpointd import TrainingProgress


def test_history_keeps_the_newest_values_per_metric() -> None:
    progress = TrainingProgress(history_limit=3)
    for i in range(10):
        progress.record(samples=2, loss=float(i), lr=0.1 * i)
    assert progress.history["loss"] == [7.0, 8.0, 9.0]
    assert progress.history["lr"] == pytest.approx([0.7, 0.8, 0.9])
    assert progress.samples_seen == 20  # counters are not bounded


def test_history_is_bounded_by_default() -> None:
    progress = TrainingProgress()
    for i in range(5000):
        progress.record(loss=float(i))
    assert len(progress.history["loss"]) == 1000
    assert progress.history["loss"][-1] == 4999.0
    assert len(progress.state_dict()["history"]["loss"]) == 1000


def test_history_limit_none_keeps_everything() -> None:
    progress = TrainingProgress(history_limit=None)
    for i in range(3000):
        progress.record(loss=float(i))
    assert len(progress.history["loss"]) == 3000


def test_loading_a_longer_history_keeps_its_newest_values(tmp_path: Path) -> None:
    old = TrainingProgress(history_limit=None)
    for i in range(50):
        old.record(loss=float(i))
    with checkpointd.CheckpointWriter(str(tmp_path)) as writer:
        writer.save(1, {"progress": old}).result(timeout=60)
    resumed = TrainingProgress(history_limit=10)
    checkpointd.restore(str(tmp_path), {"progress": resumed})
    assert resumed.history["loss"] == [float(i) for i in range(40, 50)]
    everything = TrainingProgress(history_limit=None)
    checkpointd.restore(str(tmp_path), {"progress": everything})
    assert len(everything.history["loss"]) == 50


@pytest.mark.parametrize("value", [-1, 1.5, True, "10"])
def test_bad_history_limit_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match="history_limit"):
        TrainingProgress(history_limit=value)  # type: ignore[arg-type]


def test_state_dict_layout_is_unchanged() -> None:
    progress = TrainingProgress(history_limit=2)
    progress.record(loss=1.0)
    state = progress.state_dict()
    assert set(state) == {
        "epoch",
        "step",
        "batch_in_epoch",
        "samples_seen",
        "history",
        "epoch_start_generator",
    }
    assert state["history"] == {"loss": [1.0]}
