"""The documented import path ``checkpointd.transformers``.

The transformers Trainer, saving through checkpointd (its home is
``checkpointd.integrations.transformers``).
"""

from checkpointd.integrations.transformers import (
    CheckpointdMixin,
    CheckpointdTrainer,
)

__all__ = [
    "CheckpointdMixin",
    "CheckpointdTrainer",
]
