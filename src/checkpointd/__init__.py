"""checkpointd: an async background checkpoint writer for PyTorch training.

``save()`` blocks only while tensors are copied to host memory; serialization,
upload and the commit run in the background, and a checkpoint is visible only
once every byte of it is durable.
"""

from __future__ import annotations

__version__ = "0.1.0"

from checkpointd.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    RestoreMismatchError,
    StepOrderError,
    StorageCapabilityWarning,
    StorageError,
    StorageFullError,
    StorageNotFoundError,
    StoragePermissionError,
    UnsupportedValueError,
    WriterClosedError,
    WrongThreadError,
)
from checkpointd.manifest import CheckpointInfo
from checkpointd.progress import TrainingProgress
from checkpointd.restore import Checkpoint, RestoreInfo, list_checkpoints, load, restore
from checkpointd.retention import RetentionPolicy
from checkpointd.rng import RNGState
from checkpointd.writer import AsyncCheckpointWriter, CheckpointWriter, SaveHandle

__all__ = [
    "AsyncCheckpointWriter",
    "Checkpoint",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CheckpointWriter",
    "CorruptCheckpointError",
    "IncompatibleCheckpointError",
    "RNGState",
    "RestoreInfo",
    "RestoreMismatchError",
    "RetentionPolicy",
    "SaveHandle",
    "StepOrderError",
    "StorageCapabilityWarning",
    "StorageError",
    "StorageFullError",
    "StorageNotFoundError",
    "StoragePermissionError",
    "TrainingProgress",
    "UnsupportedValueError",
    "WriterClosedError",
    "WrongThreadError",
    "__version__",
    "list_checkpoints",
    "load",
    "restore",
]
