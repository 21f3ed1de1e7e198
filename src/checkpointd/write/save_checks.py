"""A save's step, checked on the caller's thread before anything is captured.

In range, not being saved already, not committed already, and (with
``newer_steps="error"``) not older than a step that is committed or being saved:
such a save raises at once instead of failing in the background.
"""

from __future__ import annotations

from collections.abc import Sequence

from checkpointd.errors import CheckpointExistsError, InvalidArgumentError, StepOrderError
from checkpointd.format.layout import MAX_STEP, is_step
from checkpointd.write.handle import SaveHandle
from checkpointd.write.loop import NewerSteps

__all__ = ["check_step"]


def check_step(
    step: int,
    *,
    newest: int | None,
    pending: Sequence[SaveHandle],
    newer_steps: NewerSteps,
    root: str,
) -> None:
    """Raise if a save of ``step`` may not start: ``newest`` is the newest committed step,
    ``pending`` the saves not yet resolved, ``root`` names the root in messages.

    Raises InvalidArgumentError (not a step), CheckpointExistsError (being saved, or
    committed) or StepOrderError (older than a newer step, with ``newer_steps="error"``).
    Caller's thread.
    """
    if not is_step(step):
        raise InvalidArgumentError(f"step must be an int from 0 to {MAX_STEP}, not {step!r}")
    if any(h.step == step for h in pending):
        raise CheckpointExistsError(f"a save of step {step} is already in progress")
    if step == newest:
        raise CheckpointExistsError(f"step {step} is already committed under {root}")
    if newer_steps != "error":
        return
    if newest is not None and step < newest:
        what = f"step {newest}, the newest committed checkpoint"
    elif any(h.step > step for h in pending):
        what = f"step {max(h.step for h in pending)}, which is being saved,"
    else:
        return
    raise StepOrderError(
        f"step {step} is older than {what} under {root}: a resume would pick the "
        "newer step and skip this one. Pass newer_steps='discard' to the writer to delete "
        "the newer steps once this one is committed, or newer_steps='keep' to keep them"
    )
