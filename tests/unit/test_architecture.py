"""docs/architecture.md names every module of the package, and only modules that exist."""

from __future__ import annotations

import re
from pathlib import Path

import checkpointd

SRC = Path(checkpointd.__file__).parent
DOC = Path(__file__).parents[2] / "docs" / "architecture.md"

# A line of the layout tree: its drawing, the entry's name, then what it does.
_ENTRY = re.compile(r"^(?P<indent>(?:│   |    )*)(?:├── |└── )(?P<name>\S+)(?:\s+(?P<job>.*))?$")


def _layout_block() -> list[str]:
    text = DOC.read_text()
    section = text.split("\n## The layout\n", 1)[1]
    block = section.split("```", 2)[1]
    lines = block.strip("\n").splitlines()
    assert lines[0] == "src/checkpointd/", lines[0]
    return lines[1:]


def documented_modules() -> dict[str, str]:
    """Path relative to the package (``write/plan.py``) -> the job the tree gives it; a
    folder's line stands for its ``__init__.py``."""
    found: dict[str, str] = {}
    folders: list[str] = []
    for line in _layout_block():
        match = _ENTRY.match(line)
        assert match, f"not a line of the tree: {line!r}"
        depth = len(match["indent"]) // 4
        assert depth <= len(folders), f"indented under no folder: {line!r}"
        del folders[depth:]
        name, job = match["name"], match["job"] or ""
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
            path = "/".join([*folders, "__init__.py"])
        else:
            path = "/".join([*folders, name])
        assert path not in found, f"{path} is named twice"
        assert job.strip(), f"{path} has no job in the tree"
        found[path] = job
    return found


def test_architecture_names_every_module_and_no_other() -> None:
    modules = {p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")}
    documented = documented_modules().keys()
    assert sorted(modules - documented) == [], "modules missing from docs/architecture.md"
    assert sorted(documented - modules) == [], "docs/architecture.md names modules that are gone"


def test_the_tree_is_read_as_drawn() -> None:
    # The parser itself: nesting and a folder standing for its __init__.py.
    documented = documented_modules()
    assert "write/plan.py" in documented
    assert "daemon/__init__.py" in documented
    assert "cli/demo.py" in documented
    assert "plan.py" not in documented


MAX_LINES = 400


def test_every_module_keeps_at_most_400_lines() -> None:
    # One module, one job (issue 32): a module past this has grown a second job to move out.
    over = {
        p.relative_to(SRC).as_posix(): n
        for p in sorted(SRC.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert over == {}, f"modules over {MAX_LINES} lines: {over}"
