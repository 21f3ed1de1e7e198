"""The documented import path ``checkpointd.torchtitan``.

A torchtitan checkpoint manager, saving through checkpointd (its home is
``checkpointd.integrations.torchtitan``).
"""

from checkpointd.integrations.torchtitan import (
    CheckpointdManager,
)

__all__ = [
    "CheckpointdManager",
]
