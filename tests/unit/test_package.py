"""The package root: lazy public names, no torch on import, no import cycles, one error root."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

import checkpointd
import checkpointd.maintain.retention
import checkpointd.read.catalog
from checkpointd import errors

SRC = pathlib.Path(checkpointd.__file__).parent


def _run(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_import_checkpointd_does_not_import_torch() -> None:
    _run("import checkpointd, sys; assert 'torch' not in sys.modules, 'torch imported'")


def test_listing_names_do_not_import_torch() -> None:
    # What `ls`-like tools touch: the errors, the policy and CheckpointInfo.
    _run(
        "import sys, checkpointd\n"
        "checkpointd.CheckpointInfo, checkpointd.RetentionPolicy, checkpointd.CheckpointError\n"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )


def test_every_public_name_resolves_in_a_fresh_interpreter() -> None:
    _run(
        "import checkpointd\n"
        "missing = [n for n in checkpointd.__all__ if getattr(checkpointd, n, None) is None]\n"
        "assert not missing, missing\n"
        "assert set(checkpointd.__all__) <= set(dir(checkpointd))"
    )


def test_public_names_win_over_submodules_of_the_same_name() -> None:
    # checkpointd.restore is the function, also once the submodule restore is imported.
    _run(
        "import checkpointd.read.restore, checkpointd.api.writer, checkpointd\n"
        "assert callable(checkpointd.restore) and checkpointd.restore.__name__ == 'restore'\n"
        "from checkpointd.read.restore import RestoreInfo\n"
        "assert checkpointd.RestoreInfo is RestoreInfo"
    )


def test_all_lists_exactly_the_table_and_the_errors() -> None:
    expected = {*checkpointd._HOME_OF, *errors.__all__, "__version__"}  # noqa: SLF001 - the lazy-name table is what is tested
    assert sorted(checkpointd.__all__) == sorted(expected)  # and each once
    for name in checkpointd.__all__:
        assert hasattr(checkpointd, name), name


def test_star_import_binds_every_public_name() -> None:
    _run(
        "from checkpointd import *\n"
        "import checkpointd\n"
        "assert all(globals()[n] is getattr(checkpointd, n) for n in checkpointd.__all__)"
    )


def _type_checking_imports() -> dict[str, set[str]]:
    """Module -> names imported in __init__'s ``if _typing.TYPE_CHECKING:`` block, each
    checked to be in the ``X as X`` form that tells type checkers it is re-exported."""
    tree = ast.parse((SRC / "__init__.py").read_text())
    blocks = [
        node
        for node in tree.body
        if isinstance(node, ast.If)
        and isinstance(node.test, ast.Attribute)
        and node.test.attr == "TYPE_CHECKING"
    ]
    assert len(blocks) == 1
    found: dict[str, set[str]] = {}
    for stmt in blocks[0].body:
        assert isinstance(stmt, ast.ImportFrom), ast.dump(stmt)
        assert stmt.module
        for alias in stmt.names:
            assert alias.asname == alias.name, f"{alias.name} is not imported as itself"
            found.setdefault(stmt.module, set()).add(alias.name)
    return found


def test_type_checking_block_and_the_table_agree() -> None:
    # The block is what mypy sees, _HOMES what runs: a name in one only is a public
    # name that fails at runtime or that a type checker does not know.
    homes = checkpointd._HOMES  # noqa: SLF001 - the lazy-name table is what is tested
    table = {module: set(names) for module, names in homes.items()}
    assert _type_checking_imports() == table


def test_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = checkpointd.no_such_name  # typed Any through __getattr__, raises at runtime


def test_warnings_are_exported_and_are_the_ones_emitted() -> None:
    assert checkpointd.RetentionWarning is checkpointd.maintain.retention.RetentionWarning
    assert checkpointd.CheckpointWarning is checkpointd.read.catalog.CheckpointWarning


def test_no_module_imports_a_name_from_the_package_root() -> None:
    """``from checkpointd import X`` inside the package is a cycle (commit -> root for
    __version__ was one); only submodules may be imported that way."""
    modules = {p.stem for p in SRC.glob("*.py")} | {p.name for p in SRC.iterdir() if p.is_dir()}
    offenders = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == "checkpointd"
                and node.level == 0
            ):
                offenders += [f"{path.name}: {a.name}" for a in node.names if a.name not in modules]
    assert not offenders


def test_every_exception_class_derives_from_checkpoint_error() -> None:
    classes = [getattr(errors, n) for n in errors.__all__]
    exceptions = [c for c in classes if not issubclass(c, Warning)]
    assert all(issubclass(c, errors.CheckpointError) for c in exceptions)
    assert issubclass(errors.InvalidArgumentError, ValueError)
    assert issubclass(errors.CheckpointTimeoutError, TimeoutError)
