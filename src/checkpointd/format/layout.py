"""Where things are in a root: step folders, file names, name rules, alignment, and
the tunable part of a save's layout (SaveLayout, which travels with a snapshot).

The one home of the naming conventions of docs/format.md ("Component names and
file names", "Storage layout"): writers, readers, the catalog and gc all use
these, so a rule changes in one place. Pure functions; no I/O; any thread.
"""

from __future__ import annotations

import re

import msgspec

from checkpointd import tunables
from checkpointd.errors import InvalidArgumentError, UnsupportedValueError

__all__ = [
    "BLOBS_DIR",
    "BLOB_PREFIX",
    "DIRECT_ALIGN",
    "HEADER_ALIGN",
    "MANIFEST_NAME",
    "MAX_STEP",
    "PINS_DIR",
    "REGION_ALIGN",
    "TEMP_MARKER",
    "SaveLayout",
    "blob_path",
    "check_component_name",
    "is_blob_name",
    "is_component_name",
    "is_rank_file",
    "is_safe_file_name",
    "is_step",
    "is_temp_name",
    "parse_step_dirname",
    "shard_file_name",
    "shard_index_name",
    "step_dirname",
    "tensor_file_name",
    "tree_file_name",
]

# --- steps -------------------------------------------------------------------

STEP_DIGITS = 12
MAX_STEP = 10**STEP_DIGITS - 1
"""The largest step: step folders are 12 zero-padded digits, so names sort like numbers."""
_STEP_DIR = re.compile(rf"[0-9]{{{STEP_DIGITS}}}\Z")


def step_dirname(step: int) -> str:
    """The folder name of a step: zero-padded so names sort like numbers."""
    return f"{step:0{STEP_DIGITS}d}"


def parse_step_dirname(name: str) -> int | None:
    """The step a folder name stands for, or None if it is not a step folder."""
    return int(name) if _STEP_DIR.match(name) else None


def is_step(step: object) -> bool:
    """True for an int (not a bool) from 0 to MAX_STEP."""
    return isinstance(step, int) and not isinstance(step, bool) and 0 <= step <= MAX_STEP


# --- names -------------------------------------------------------------------

MANIFEST_NAME = "manifest.json"
"""The commit marker in each step folder; written last."""
TEMP_MARKER = ".tmp-"
"""Part of the name of a local file being written (``{final}.tmp-<hex>``)."""

_COMPONENT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_\-]{0,127}\Z")
_SAFE_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}\Z")


def is_component_name(name: object) -> bool:
    """The one component-name rule (docs/format.md): 1-128 ASCII letters, digits,
    ``_`` or ``-``, not starting with ``-``. Used by save and by manifest checks."""
    return isinstance(name, str) and bool(_COMPONENT_NAME.match(name))


def check_component_name(name: object) -> str:
    """Return ``name`` if it can name a component, else raise UnsupportedValueError."""
    if not is_component_name(name):
        raise UnsupportedValueError(
            f"component name {name!r} must be 1-128 characters of ASCII letters, digits, '_' or "
            "'-', not starting with '-'"
        )
    assert isinstance(name, str)
    return name


def is_safe_file_name(name: str) -> bool:
    """True for a file name that stays inside its step folder: no ``/``, no ``..``,
    not starting with ``.`` (or ``-``), at most 200 characters."""
    return bool(_SAFE_FILE_NAME.match(name)) and ".." not in name


def is_temp_name(name: str) -> bool:
    """True for the name of a local file still being written."""
    return TEMP_MARKER in name


def tree_file_name(component: str, token: str | None = None) -> str:
    """File name of a component's state tree: ``C.T.tree.msgpack`` for save attempt
    ``T`` (earlier versions wrote ``C.tree.msgpack``, without a token)."""
    return f"{component}.tree.msgpack" if token is None else f"{component}.{token}.tree.msgpack"


def tensor_file_name(component: str, token: str | None = None) -> str:
    """File name of a component's tensors: ``C.T.safetensors`` (``C.safetensors`` untokened)."""
    return f"{component}.safetensors" if token is None else f"{component}.{token}.safetensors"


def shard_file_name(component: str, token: str, rank: int) -> str:
    """File name of the shards rank ``rank`` stores of a component's sharded tensors:
    ``C.T.rankR.safetensors``."""
    return f"{component}.{token}.rank{rank}.safetensors"


def shard_index_name(token: str, rank: int) -> str:
    """File name of rank ``rank``'s shard index (schema 4): ``shards.T.rankR.json``."""
    return f"shards.{token}.rank{rank}.json"


def is_rank_file(path: str, rank: int) -> bool:
    """True if ``path``'s name says only rank ``rank`` wrote it: its shards
    (``shard_file_name``), its shard index (``shard_index_name``) or a file of a per-rank
    component (``C-rankR.…``). A file every rank holds alike is named so only by accident."""
    return re.search(rf"[.-]rank{rank}\.", path.rsplit("/", 1)[-1]) is not None


# --- shared blobs (incremental saves) ------------------------------------------

BLOBS_DIR = "blobs"
"""Folder under the root of content-addressed tensor bytes, shared by checkpoints."""
PINS_DIR = "pins"
"""Folder under the root where saves in flight name the blobs they may reference."""
BLOB_PREFIX = "xxh128-"
_BLOB_NAME = re.compile(r"xxh128-[0-9a-f]{32}\Z")


def is_blob_name(name: object) -> bool:
    """True for a blob name: ``xxh128-`` and 32 lowercase hex digits."""
    return isinstance(name, str) and bool(_BLOB_NAME.match(name))


def blob_path(name: str) -> str:
    """The path of blob ``name`` relative to the root."""
    return f"{BLOBS_DIR}/{name}"


# --- alignment ---------------------------------------------------------------

DIRECT_ALIGN = 4096
"""Alignment of address, position and length for O_DIRECT; 4 KiB covers 512-byte
and 4K-sector devices."""
REGION_ALIGN = DIRECT_ALIGN
"""Components start on this boundary of the staging arena (itself so aligned), so
their data regions can be written with direct I/O."""
HEADER_ALIGN = 8
"""A safetensors header is padded so the data region starts at a multiple of this;
data regions of DIRECT_MIN_BYTES or more are padded to DIRECT_ALIGN instead."""


# --- the tunable part of a save's layout ----------------------------------------


class SaveLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The tunables that decide which files a save writes and how they are laid out,
    read once in the process that calls ``save()`` (``SaveLayout.now()``) and kept with
    its snapshot: the checkpoint service plans with the trainer's values, not its own,
    so a save through it writes the files an in-process save would."""

    shard_block: int
    """Bytes per CRC32C block of each shard (``tunables.SHARD_BLOCK_BYTES``)."""
    direct_min: int
    """A tensor file's data region of this many bytes or more starts DIRECT_ALIGN-aligned
    (``tunables.DIRECT_MIN_BYTES``)."""
    shard_index_min: int
    """A many-rank save whose manifest would list this many shard entries or more keeps
    them in index files (``tunables.SHARD_INDEX_MIN_ENTRIES``)."""
    incremental_min: int
    """An incremental save stores tensors (and shards) of this many bytes or more as
    shared blobs (``tunables.INCREMENTAL_MIN_BYTES``; 0 counts as 1)."""

    @classmethod
    def now(cls) -> SaveLayout:
        """The tunables as they are now (any thread)."""
        return cls(
            tunables.SHARD_BLOCK_BYTES,
            tunables.DIRECT_MIN_BYTES,
            tunables.SHARD_INDEX_MIN_ENTRIES,
            tunables.INCREMENTAL_MIN_BYTES,
        )

    def check(self) -> None:
        """InvalidArgumentError unless the shard block is positive and no threshold is
        negative (the service checks a layout a client sent with this)."""
        if self.shard_block < 1:
            raise InvalidArgumentError(f"shard block size {self.shard_block} is not positive")
        for what, value in (
            ("direct I/O", self.direct_min),
            ("shard index", self.shard_index_min),
            ("incremental", self.incremental_min),
        ):
            if value < 0:
                raise InvalidArgumentError(f"{what} threshold {value} is negative")
