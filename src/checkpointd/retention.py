"""The documented import path ``checkpointd.retention``.

Retention policies (its home is ``checkpointd.maintain.retention``).
"""

from checkpointd.maintain.retention import (
    RetentionPlan,
    RetentionPolicy,
    RetentionWarning,
    WriterIdentity,
    apply_retention,
    delete_checkpoint,
    delete_checkpoints,
    plan_retention,
)

__all__ = [
    "RetentionPlan",
    "RetentionPolicy",
    "RetentionWarning",
    "WriterIdentity",
    "apply_retention",
    "delete_checkpoint",
    "delete_checkpoints",
    "plan_retention",
]
