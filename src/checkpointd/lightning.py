"""The documented import path ``checkpointd.lightning``.

Lightning's CheckpointIO plugin (its home is ``checkpointd.integrations.lightning``).
"""

from checkpointd.integrations.lightning import (
    CheckpointdIO,
    checkpoint_root,
    last_checkpoint,
)

__all__ = [
    "CheckpointdIO",
    "checkpoint_root",
    "last_checkpoint",
]
