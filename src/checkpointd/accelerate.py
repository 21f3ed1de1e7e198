"""The documented import path ``checkpointd.accelerate``.

Accelerate's Accelerator, saved and restored (its home is ``checkpointd.integrations.accelerate``).
"""

from checkpointd.integrations.accelerate import (
    accelerator_state,
    load_state,
    rest_of_epoch,
    save_state,
)

__all__ = [
    "accelerator_state",
    "load_state",
    "rest_of_epoch",
    "save_state",
]
