"""checkpointd: an async background checkpoint writer for PyTorch training.

``save()`` blocks only while tensors are copied to host memory; serialization,
upload and the commit run in the background, and a checkpoint is visible only
once every byte of it is durable.

The public names are imported on first use (PEP 562), so ``import checkpointd``
stays cheap (no torch) for tools that only list or check checkpoints; submodules
(``checkpointd.tunables``...) load on first attribute access too. The error and
warning classes (``errors.__all__``) are bound at import: errors imports nothing.
"""

from __future__ import annotations

import importlib as _importlib
import logging as _logging
import typing as _typing

from checkpointd._version import __version__ as __version__
from checkpointd.errors import *  # noqa: F403  (errors imports nothing: cheap to bind now)

# Every module logs under its own name below "checkpointd"; nothing is shown until the
# application configures logging (the README says how), not even warnings.
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

# The lazy names, by home module: the one table __getattr__ and __all__ read.
_HOMES: dict[str, tuple[str, ...]] = {
    "checkpointd.api.async_writer": ("AsyncCheckpointWriter",),
    "checkpointd.api.restore": ("restore",),
    "checkpointd.api.writer": ("CheckpointWriter", "SaveHandle"),
    "checkpointd.format.manifest": ("CheckpointInfo",),
    "checkpointd.interop.foreign": ("import_checkpoint",),
    "checkpointd.maintain.retention": ("RetentionPolicy",),
    "checkpointd.ranks.group": ("LOCAL", "PerRank"),
    "checkpointd.read.restore": (
        "Checkpoint",
        "RestoreInfo",
        "SkippedStep",
        "list_checkpoints",
        "load",
    ),
    "checkpointd.rebuild.allowlist": ("BUILTIN_ALLOW",),
    "checkpointd.rebuild.build": ("build",),
    "checkpointd.rebuild.spec": ("spec",),
    "checkpointd.state.progress": ("TrainingProgress",),
    "checkpointd.state.rng": ("RNGState",),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> _typing.Any:
    """Import a public name's home module on first use; or a submodule of that name."""
    home = _HOME_OF.get(name)
    if home is not None:
        value = getattr(_importlib.import_module(home), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    if not name.startswith("_"):
        try:
            return _importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME_OF})


if _typing.TYPE_CHECKING:
    # The same table as imports, for type checkers (they cannot run __getattr__); the
    # ``X as X`` form marks each a re-export. tests/unit/test_package.py keeps it and
    # _HOMES in step.
    from checkpointd.api.async_writer import AsyncCheckpointWriter as AsyncCheckpointWriter
    from checkpointd.api.restore import restore as restore
    from checkpointd.api.writer import CheckpointWriter as CheckpointWriter
    from checkpointd.api.writer import SaveHandle as SaveHandle
    from checkpointd.format.manifest import CheckpointInfo as CheckpointInfo
    from checkpointd.interop.foreign import import_checkpoint as import_checkpoint
    from checkpointd.maintain.retention import RetentionPolicy as RetentionPolicy
    from checkpointd.ranks.group import LOCAL as LOCAL
    from checkpointd.ranks.group import PerRank as PerRank
    from checkpointd.read.restore import Checkpoint as Checkpoint
    from checkpointd.read.restore import RestoreInfo as RestoreInfo
    from checkpointd.read.restore import SkippedStep as SkippedStep
    from checkpointd.read.restore import list_checkpoints as list_checkpoints
    from checkpointd.read.restore import load as load
    from checkpointd.rebuild.allowlist import BUILTIN_ALLOW as BUILTIN_ALLOW
    from checkpointd.rebuild.build import build as build
    from checkpointd.rebuild.spec import spec as spec
    from checkpointd.state.progress import TrainingProgress as TrainingProgress
    from checkpointd.state.rng import RNGState as RNGState
else:
    # Hidden from type checkers: mypy reads only a literal __all__ and would take this
    # derived one as empty, making every name above private.
    from checkpointd import errors

    __all__ = ["__version__"]
    __all__ += errors.__all__
    __all__.extend(_HOME_OF)
