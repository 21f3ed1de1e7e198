"""docs/architecture.md names every module of the package, and only modules that exist; its
subpackages import only the layers below them, in the order the document declares."""

from __future__ import annotations

import ast
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


def declared_layers() -> list[str]:
    """The subpackages in the order docs/architecture.md's "Layers" section lists them,
    lowest first (the section draws them top down)."""
    section = DOC.read_text().split("\n## Layers\n", 1)[1]
    block = section.split("```", 2)[1]
    return [line.split()[0] for line in reversed(block.strip("\n").splitlines())]


def package_imports(
    src: Path = SRC, prefix: tuple[str, ...] = ("checkpointd",)
) -> dict[str, dict[str, str]]:
    """Subpackage of ``src`` (the package ``prefix``) -> the other subpackages it imports,
    each with one importing module.

    Every import counts, at module level or inside a function (it runs when called); an
    import under ``if TYPE_CHECKING:`` never runs and does not count. Relative imports are
    resolved; ``from checkpointd import read`` counts as importing ``read``.
    """
    packages = {p.name for p in src.iterdir() if (p / "__init__.py").is_file()}
    found: dict[str, dict[str, str]] = {}
    for path in sorted(src.rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        if len(parts) < 2:
            continue  # the package root's modules sit above every layer
        own = parts[0]
        tree = ast.parse(path.read_text())
        skipped: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                for inner in node.body:
                    skipped.update(id(x) for x in ast.walk(inner))
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            targets: list[list[str]] = []
            if isinstance(node, ast.Import):
                targets = [alias.name.split(".") for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    package = [*prefix, *parts[:-1]]
                    base = package[: len(package) - (node.level - 1)]
                else:
                    base = []
                module = [*base, *(node.module.split(".") if node.module else [])]
                targets = [module] if len(module) > 1 else []
                if module == list(prefix):
                    targets = [[*prefix, alias.name] for alias in node.names]
            for target in targets:
                if tuple(target[: len(prefix)]) != prefix or len(target) <= len(prefix):
                    continue
                other = target[len(prefix)]
                if other in packages and other != own:
                    found.setdefault(own, {}).setdefault(other, path.relative_to(src).as_posix())
    return found


def test_layers_name_every_subpackage_once() -> None:
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    layers = declared_layers()
    assert len(layers) == len(set(layers)), f"a package is listed twice: {layers}"
    assert sorted(layers) == sorted(packages)


def test_subpackages_import_only_lower_layers() -> None:
    # Issue 32: the subpackages form a DAG, in the order docs/architecture.md declares
    # (function-level imports count; TYPE_CHECKING ones do not). Before, read, write,
    # ranks, maintain, rebuild and daemon reached each other in 12 pairs.
    rank = {name: i for i, name in enumerate(declared_layers())}
    upward = sorted(
        f"{module} imports {other} ({package} is not above {other})"
        for package, others in package_imports().items()
        for other, module in others.items()
        if rank[other] >= rank[package]
    )
    assert upward == [], "imports against the declared layers:\n" + "\n".join(upward)


def test_the_daemon_sides_meet_only_in_wire() -> None:
    # Issue 32 item 4: the trainer's client and the service's server each have a home and
    # speak through daemon/wire; neither side imports the other, and wire imports neither.
    allowed = {"wire": set[str](), "client": {"wire"}, "server": {"wire"}}
    found = package_imports(SRC / "daemon", ("checkpointd", "daemon"))
    assert sorted(found) != [], "no imports found between the daemon's sides"
    crossing = sorted(
        f"{module} imports daemon.{other}"
        for side, others in found.items()
        for other, module in others.items()
        if other not in allowed[side]
    )
    assert crossing == [], "the daemon's sides reach each other:\n" + "\n".join(crossing)
