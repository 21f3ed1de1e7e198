"""The checkpoint a CheckpointdTrainer's ``train`` resumes from: which one, its small
components loaded first, and whether it fits this run.

The resume half of checkpointd.integrations.transformers (whose module docstring says
what resuming means); the component names a save holds live here so both halves share
them. Imports no transformers; training thread.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from checkpointd.errors import InvalidArgumentError, RestoreMismatchError
from checkpointd.format.manifest import CheckpointInfo
from checkpointd.read.catalog import list_checkpoints
from checkpointd.read.restore import load
from checkpointd.state.rng import RNGState
from checkpointd.storage import resolve_root

__all__ = ["Applied", "Resume", "open_resume"]

MODEL, OPTIMIZER, SCHEDULER, SCALER = "model", "optimizer", "scheduler", "scaler"
RNG, STATE, LOOP = "rng", "trainer_state", "loop"

Which = bool | int | str | os.PathLike[str] | tuple[str, int]


class Applied:
    """A restore target for a component already applied: it takes the tree, does nothing.

    The trainer state and RNG are needed before the optimizer exists.
    """

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Any) -> None:
        pass


class Resume:
    """The checkpoint a ``train`` call resumes from, loaded in two parts."""

    def __init__(self, root: str, info: CheckpointInfo, trees: Mapping[str, Any]) -> None:
        self.root = root
        self.info = info
        self.trees = trees
        # What Trainer passes around as ``resume_from_checkpoint``; never read as a folder.
        self.marker = info.path


def open_resume(
    which: Which,
    *,
    root: str,
    storage_options: Mapping[str, Any] | None,
    position_args: Mapping[str, Any],
) -> Resume:
    """Load the small components (trainer state, RNG, loop) of the checkpoint to resume.

    ``which`` is ``train``'s ``resume_from_checkpoint`` (True: the newest of ``root``, the
    trainer's own), and ``position_args`` the arguments deciding this run's data
    position, which must equal the saved ones (RestoreMismatchError, as is an RNG state
    that does not fit this process). Rolling back into ``root`` itself is refused
    (InvalidArgumentError). The rest is restored once the optimizer exists.
    """
    own, step = root, None
    if isinstance(which, tuple):
        root, step = resolve_root(which[0]), int(which[1])
    elif isinstance(which, str | os.PathLike):
        root = resolve_root(which)
    elif not isinstance(which, bool):
        step = int(which)
    checkpoint = load(root, step, components=[STATE, RNG, LOOP], storage_options=storage_options)
    if root == own and step is not None:
        newest = list_checkpoints(root, storage_options=storage_options)[-1].step
        if newest > step:
            raise InvalidArgumentError(
                f"cannot resume from step {step} into {root}: it holds newer steps (up to "
                f"{newest}) of the run being rolled back, which this run's saves would "
                "meet; resume into another root: CheckpointdTrainer(..., "
                f"checkpointd_root=NEW).train(resume_from_checkpoint=({root!r}, {step}))"
            )
    saved = checkpoint.info.metadata.get("transformers_args", {})
    differ = [
        f"{k}: saved {saved.get(k)!r}, now {v!r}"
        for k, v in position_args.items()
        if saved.get(k) != v
    ]
    if differ:
        raise RestoreMismatchError(
            f"checkpoint {checkpoint.info.path} was saved with other training arguments, so "
            f"its data position does not apply: {'; '.join(differ)}"
        )
    RNGState().check_state_dict(checkpoint.state[RNG])
    return Resume(root, checkpoint.info, checkpoint.state)
