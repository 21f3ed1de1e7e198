"""checkpointd: an async background checkpoint writer for PyTorch training.

``save()`` blocks only while tensors are copied to host memory; serialization,
upload and the commit run in the background, and a checkpoint is visible only
once every byte of it is durable.

The public names are imported on first use (PEP 562), so ``import checkpointd``
stays cheap (no torch) for tools that only list or check checkpoints; submodules
(``checkpointd.tunables``...) load on first attribute access too.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from checkpointd._version import __version__

if TYPE_CHECKING:
    from checkpointd.errors import (
        CheckpointError,
        CheckpointExistsError,
        CheckpointNotFoundError,
        CheckpointTimeoutError,
        CheckpointWarning,
        CorruptCheckpointError,
        IncompatibleCheckpointError,
        InvalidArgumentError,
        RankFailedError,
        RestoreMismatchError,
        ResumeNotExactWarning,
        RetentionWarning,
        ServiceError,
        ServiceMemoryError,
        SpecChangedWarning,
        StagingError,
        StepOrderError,
        StorageCapabilityWarning,
        StorageError,
        StorageFullError,
        StorageNotFoundError,
        StoragePermissionError,
        UnsafeSpecError,
        UnsupportedValueError,
        ValidationFailedError,
        WriterClosedError,
        WrongThreadError,
    )
    from checkpointd.format.manifest import CheckpointInfo
    from checkpointd.interop.foreign import import_checkpoint
    from checkpointd.maintain.retention import RetentionPolicy
    from checkpointd.ranks.group import LOCAL, PerRank
    from checkpointd.read.restore import (
        Checkpoint,
        RestoreInfo,
        SkippedStep,
        list_checkpoints,
        load,
        restore,
    )
    from checkpointd.rebuild.allowlist import BUILTIN_ALLOW
    from checkpointd.rebuild.build import build
    from checkpointd.rebuild.spec import spec
    from checkpointd.state.progress import TrainingProgress
    from checkpointd.state.rng import RNGState
    from checkpointd.write.writer import AsyncCheckpointWriter, CheckpointWriter, SaveHandle

_HOMES: dict[str, tuple[str, ...]] = {
    "checkpointd.errors": (
        "CheckpointError",
        "CheckpointExistsError",
        "CheckpointNotFoundError",
        "CheckpointTimeoutError",
        "CheckpointWarning",
        "CorruptCheckpointError",
        "IncompatibleCheckpointError",
        "InvalidArgumentError",
        "RankFailedError",
        "RestoreMismatchError",
        "ResumeNotExactWarning",
        "RetentionWarning",
        "ServiceError",
        "ServiceMemoryError",
        "StagingError",
        "StepOrderError",
        "StorageCapabilityWarning",
        "StorageError",
        "StorageFullError",
        "StorageNotFoundError",
        "SpecChangedWarning",
        "StoragePermissionError",
        "UnsafeSpecError",
        "UnsupportedValueError",
        "ValidationFailedError",
        "WriterClosedError",
        "WrongThreadError",
    ),
    "checkpointd.rebuild.allowlist": ("BUILTIN_ALLOW",),
    "checkpointd.rebuild.build": ("build",),
    "checkpointd.interop.foreign": ("import_checkpoint",),
    "checkpointd.ranks.group": ("LOCAL", "PerRank"),
    "checkpointd.format.manifest": ("CheckpointInfo",),
    "checkpointd.state.progress": ("TrainingProgress",),
    "checkpointd.read.restore": (
        "Checkpoint",
        "RestoreInfo",
        "SkippedStep",
        "list_checkpoints",
        "load",
        "restore",
    ),
    "checkpointd.maintain.retention": ("RetentionPolicy",),
    "checkpointd.state.rng": ("RNGState",),
    "checkpointd.rebuild.spec": ("spec",),
    "checkpointd.write.writer": ("AsyncCheckpointWriter", "CheckpointWriter", "SaveHandle"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [
    "BUILTIN_ALLOW",
    "LOCAL",
    "AsyncCheckpointWriter",
    "Checkpoint",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CheckpointTimeoutError",
    "CheckpointWarning",
    "CheckpointWriter",
    "CorruptCheckpointError",
    "IncompatibleCheckpointError",
    "InvalidArgumentError",
    "PerRank",
    "RNGState",
    "RankFailedError",
    "RestoreInfo",
    "RestoreMismatchError",
    "ResumeNotExactWarning",
    "RetentionPolicy",
    "RetentionWarning",
    "SaveHandle",
    "ServiceError",
    "ServiceMemoryError",
    "SkippedStep",
    "SpecChangedWarning",
    "StagingError",
    "StepOrderError",
    "StorageCapabilityWarning",
    "StorageError",
    "StorageFullError",
    "StorageNotFoundError",
    "StoragePermissionError",
    "TrainingProgress",
    "UnsafeSpecError",
    "UnsupportedValueError",
    "ValidationFailedError",
    "WriterClosedError",
    "WrongThreadError",
    "__version__",
    "build",
    "import_checkpoint",
    "list_checkpoints",
    "load",
    "restore",
    "spec",
]


def __getattr__(name: str) -> Any:
    """Import a public name's home module on first use; or a submodule of that name."""
    home = _HOME_OF.get(name)
    if home is not None:
        value = getattr(importlib.import_module(home), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    if not name.startswith("_"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
