"""TrainingProgress.history is bounded, so a save's blocked time does not grow with the run."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

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


def _loader(**options: object) -> torch.utils.data.DataLoader[tuple[torch.Tensor, ...]]:
    data = torch.utils.data.TensorDataset(torch.arange(12))
    sampler = torch.utils.data.distributed.DistributedSampler(data, num_replicas=2, rank=0)
    return torch.utils.data.DataLoader(data, batch_size=2, sampler=sampler, **options)  # type: ignore[arg-type]


def _mid_epoch() -> TrainingProgress:
    progress = TrainingProgress()
    for _ in progress.epoch_batches(_loader()):
        if progress.batch_in_epoch == 2:
            break
    resumed = TrainingProgress()
    resumed.load_state_dict(progress.state_dict())
    return resumed


def test_a_mid_epoch_resume_without_the_loaders_generator_warns_once() -> None:
    """iter(loader) draws from torch's global generator: a resume that iterates again
    draws twice where the run it resumes drew once, so it is not bit-exact."""
    resumed = _mid_epoch()
    with pytest.warns(
        checkpointd.ResumeNotExactWarning, match=r"generator=g.*epoch_batches\(loader, g\)"
    ):
        batches = list(resumed.epoch_batches(_loader()))
    assert len(batches) == 1  # 3 batches per epoch on this rank, 2 consumed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):  # later epochs start at their beginning: nothing to rewind
            list(resumed.epoch_batches(_loader()))


def test_a_mid_epoch_resume_with_the_loaders_own_generator_unpassed_names_it() -> None:
    resumed = _mid_epoch()
    loader = _loader(generator=torch.Generator().manual_seed(0))
    with pytest.warns(checkpointd.ResumeNotExactWarning, match=r"loader\.generator"):
        list(resumed.epoch_batches(loader))
