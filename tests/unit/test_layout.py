"""layout.py and tunables.py: the one home of naming rules, alignment and tunables."""

from __future__ import annotations

import ast
import inspect
import itertools
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch

import checkpointd
from checkpointd import tunables
from checkpointd.errors import CorruptCheckpointError, UnsupportedValueError
from checkpointd.format import layout
from checkpointd.format.manifest import (
    ComponentEntry,
    FileEntry,
    Manifest,
    decode_manifest,
    encode_manifest,
)
from checkpointd.read.catalog import step_folders
from checkpointd.storage import LocalStore, directio


def test_step_dirname_round_trips() -> None:
    for step in (0, 7, 10**6, layout.MAX_STEP):
        name = layout.step_dirname(step)
        assert len(name) == 12
        assert layout.parse_step_dirname(name) == step
    assert layout.parse_step_dirname("00000000001") is None  # 11 digits
    assert layout.parse_step_dirname("0000000000001") is None  # 13 digits
    assert layout.parse_step_dirname("00000000000x") is None


def test_folders_named_with_non_ascii_digits_are_not_steps(tmp_path: Path) -> None:
    # Before: the catalog matched r"\d{12}", which takes any Unicode digit, and int()
    # parses them, so this folder listed as step 12 (whose folder is not this one).
    (tmp_path / ("\u0660" * 10 + "\u0661\u0662")).mkdir()
    (tmp_path / "000000000005").mkdir()
    store = LocalStore(str(tmp_path))
    assert step_folders(store) == [5]


def _manifest(component: str) -> bytes:
    return encode_manifest(
        Manifest(
            schema_version=1,
            step=1,
            created_at=datetime.now(UTC),
            library_version="test",
            components={component: ComponentEntry(tree="t.tree.msgpack")},
            files=[FileEntry("t.tree.msgpack", 1, 0)],
        )
    )


@pytest.mark.parametrize("name", ["model", "a" * 128, "_x", "0", "opt-1", "Z_9-z"])
def test_a_name_save_accepts_is_a_name_readers_accept(name: str) -> None:
    assert layout.check_component_name(name) == name
    assert decode_manifest(_manifest(name)).components.keys() == {name}


@pytest.mark.parametrize("name", ["a.b", "a" * 129, "-a", "", ".hidden", "a/b", "é"])
def test_save_and_readers_refuse_the_same_names(name: str) -> None:
    # Before: save refused "a.b" and 129-200 character names, readers accepted them.
    with pytest.raises(UnsupportedValueError, match="component name"):
        layout.check_component_name(name)
    with pytest.raises(CorruptCheckpointError, match="component name"):
        decode_manifest(_manifest(name))


def test_save_refuses_a_bad_component_name(tmp_path: Path) -> None:
    with (
        checkpointd.CheckpointWriter(str(tmp_path)) as writer,
        pytest.raises(UnsupportedValueError, match="component name"),
    ):
        writer.save(1, {"a.b": torch.zeros(1)})


def test_longest_component_name_gives_safe_file_names() -> None:
    name = "a" * 128
    token = "0123abcd"
    for file in (layout.tree_file_name(name, token), layout.tensor_file_name(name, token)):
        assert layout.is_safe_file_name(file)


def test_direct_io_alignment_has_one_home() -> None:
    assert directio.DIRECT_ALIGN is layout.DIRECT_ALIGN
    assert layout.DIRECT_ALIGN % layout.HEADER_ALIGN == 0


def test_tunables_are_read_one_way_live() -> None:
    """Every module reads a tunable as ``tunables.X`` at the moment it needs it, so a
    change (a test's, a user's) takes everywhere; none copies one at import time."""
    names = {n for n in vars(tunables) if n.isupper()}
    src = Path(checkpointd.__file__).parent
    for path in sorted(src.rglob("*.py")):
        if path.name == "tunables.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.endswith("tunables"), (path, node.lineno)
                assert not {a.name for a in node.names} & names, (path, node.lineno)


def test_every_tunable_is_documented() -> None:
    """Each tunable is assigned once in tunables.py and followed by its docstring."""
    body = ast.parse(inspect.getsource(tunables)).body
    documented = {
        stmt.targets[0].id
        for stmt, after in itertools.pairwise(body)
        if isinstance(stmt, ast.Assign)
        and isinstance(stmt.targets[0], ast.Name)
        and isinstance(after, ast.Expr)
        and isinstance(after.value, ast.Constant)
        and isinstance(after.value.value, str)
    }
    assert set(tunables.__all__) == documented


def test_a_rank_file_is_known_by_the_names_the_layout_gives_it() -> None:
    for name in (
        layout.shard_file_name("model", "a1", 3),
        layout.shard_index_name("a1", 3),
        layout.tree_file_name("optimizer-rank3", "a1"),  # a per-rank component's file
    ):
        assert layout.is_rank_file(f"000000000001/{name}", 3), name
        assert not layout.is_rank_file(name, 13), name
    assert not layout.is_rank_file(layout.tree_file_name("model", "a1"), 3)
    assert not layout.is_rank_file(layout.shard_file_name("model", "a1", 31), 3)
