"""The exception hierarchy: every error checkpointd raises derives from CheckpointError.

Each also derives from the builtin a caller would catch without checkpointd
(``InvalidArgumentError`` is a ValueError, ``CheckpointTimeoutError`` a
TimeoutError, ``StorageError`` an OSError...), so ``except ValueError`` or
``except TimeoutError`` written before these existed keeps working. Bugs
(AssertionError) and interruptions (KeyboardInterrupt, cancellation) are not
wrapped. Also the warnings checkpointd emits (UserWarning subclasses).
No imports: any module may import this one.
"""

from __future__ import annotations

__all__ = [
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
    "SpecChangedWarning",
    "StagingError",
    "StepOrderError",
    "StorageCapabilityWarning",
    "StorageError",
    "StorageFullError",
    "StorageNotFoundError",
    "StoragePermissionError",
    "UnsafeSpecError",
    "UnsupportedValueError",
    "ValidationFailedError",
    "WriterClosedError",
    "WrongThreadError",
]


class CheckpointError(Exception):
    """Root of every error raised by checkpointd."""


class CheckpointNotFoundError(CheckpointError, LookupError):
    """Nothing is committed at the root, or the requested step is not committed."""


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint failed a size, digest, header or manifest check."""


class IncompatibleCheckpointError(CheckpointError):
    """The checkpoint was written in a schema this version cannot read (upgrade checkpointd)."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A checkpoint for this step is already committed, or another writer published it first."""


class UnsupportedValueError(CheckpointError, TypeError):
    """A value in the state cannot be stored without pickle (unknown type, dtype or layout)."""


class RestoreMismatchError(CheckpointError):
    """The checkpoint does not fit the live objects; nothing was changed."""


class WriterClosedError(CheckpointError, RuntimeError):
    """The writer was used after it was closed, or in a process that inherited it through fork."""


class WrongThreadError(CheckpointError, RuntimeError):
    """A blocking call was made on the writer's own event-loop thread, where it would hang."""


class InvalidArgumentError(CheckpointError, ValueError):
    """An argument is out of range or of the wrong kind (a writer option, a step, a retention rule).

    Raised at once, on the caller's thread, before anything is written.
    """


class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """A wait with a ``timeout`` ran out while saves were still running; they go on."""


class StepOrderError(CheckpointError, ValueError):
    """A save's step is not newer than a committed checkpoint (see the writer's ``newer_steps``)."""


class RankFailedError(CheckpointError, RuntimeError):
    """A save of many ranks failed elsewhere.

    Another rank failed, died or did not join it, or replicated components differ between ranks.
    """


class StagingError(CheckpointError, RuntimeError):
    """Copying the state into host memory failed in the background (overlapped staging).

    The underlying error is the cause. The save failed; the writer goes on.
    """


class ServiceError(CheckpointError, RuntimeError):
    """The checkpoint service could not be reached, refused a request, or died.

    A save in flight when it died is not visible: nothing of an unfinished save ever is.
    """


class ServiceMemoryError(ServiceError, MemoryError):
    """A save needs more shared memory than the service's ``--memory-limit`` allows."""


class StorageError(CheckpointError, OSError):
    """An I/O error from the storage backend (local disk, S3, or another fsspec store)."""


class StorageFullError(StorageError):
    """The storage ran out of space or hit a size limit (ENOSPC, EDQUOT, EFBIG)."""


class StoragePermissionError(StorageError, PermissionError):
    """The storage refused access (EACCES, EPERM, S3 AccessDenied)."""


class StorageNotFoundError(StorageError, FileNotFoundError):
    """A file or folder the operation needs does not exist in the storage."""


class UnsafeSpecError(CheckpointError):
    """A spec names a callable outside ``build(allow=...)`` or one that cannot be imported safely.

    Raised before anything is imported.
    """


class ValidationFailedError(CheckpointError):
    """A ``build(validators=...)`` callable refused a built object (its error is the cause)."""


class SpecChangedWarning(UserWarning):
    """A component's spec differs from the one this writer's previous checkpoint stored."""


class CheckpointWarning(UserWarning):
    """A step folder with a manifest was skipped because the manifest could not be read."""


class ResumeNotExactWarning(CheckpointWarning):
    """A resume cannot repeat the interrupted run bit for bit (the message says what to pass).

    ``TrainingProgress.epoch_batches`` resuming mid-epoch without the loader's generator.
    """


class RetentionWarning(UserWarning):
    """A checkpoint could not be ranked by the best-metric rule."""


class StorageCapabilityWarning(UserWarning):
    """The storage lacks a capability the commit protocol relies on.

    For example an exclusive create for the manifest; checkpointd works around it with
    weaker guarantees.
    """
