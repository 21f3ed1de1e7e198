"""No import cycle between checkpointd's modules, counting every import that runs.

What counts as an edge from module A to module B (A's source, read with ``ast``):
- every ``import B`` / ``from B import x`` in A that can run: at the top and inside
  functions (lazy imports, kept for torch-freeness or start-up time, still tie A to B
  and can fail half-initialized at run time).
- not those under ``if TYPE_CHECKING:``: they never run, so they cannot make an import
  order fail, and a module whose annotations name the type of a module that imports
  it (format/manifest_checks.py checks format/manifest.py's structs) is a layering
  mypy sees, not a cycle. Where it was cheap a Protocol removed even those
  (read/component_tensors.py's TensorSource).
- ``from P import x`` with P a package: an edge to the submodule ``P.x`` if there is
  one, else to ``P/__init__`` (a real re-export from it). Importing ``P.x`` runs
  ``P/__init__`` too, but that is Python's mechanics, not a dependency: not an edge.
  The root ``__init__`` resolves its public names lazily with importlib from a table
  (not seen here); the modules it names never import the root's names back
  (test_package.py's test_no_module_imports_a_name_from_the_package_root)."""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

import checkpointd

SRC = pathlib.Path(checkpointd.__file__).parent


def _modules(src: pathlib.Path) -> dict[str, tuple[pathlib.Path, bool]]:
    """Dotted module name -> (file, is a package ``__init__``)."""
    found = {}
    for path in src.rglob("*.py"):
        parts = list(path.relative_to(src.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def _imported(node: ast.AST, package: str) -> Iterator[tuple[str, str | None]]:
    """(module, name or None) for each thing an import statement imports."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name, None
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join([*parts, *([node.module] if node.module else [])])
        for alias in node.names:
            yield base, alias.name


def _type_checking_blocks(tree: ast.Module) -> Iterator[ast.stmt]:
    """The statements under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
            ):
                yield from node.body


def import_graph(src: pathlib.Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports anywhere in its source."""
    modules = _modules(src)
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        edges: set[str] = set()
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {id(n) for block in _type_checking_blocks(tree) for n in ast.walk(block)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            for module, attr in _imported(node, package):
                if attr is not None and f"{module}.{attr}" in modules:
                    edges.add(f"{module}.{attr}")
                elif module in modules:
                    edges.add(module)
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a closed path of modules) per strongly connected group, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group: set[str] = set()
            while node not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(_a_cycle(graph, group) for group in groups)


def _a_cycle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest closed path through the first module of ``group``."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for nxt in sorted(graph[node] & group):
            if nxt == start:
                return [*paths[node], start]
            if nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                frontier.append(nxt)
    raise AssertionError(f"no cycle through {start}")  # a group always has one


def test_no_import_cycle_between_checkpointd_modules() -> None:
    found = cycles(import_graph(SRC))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_graph_sees_lazy_and_package_imports_not_typing_only_ones(
    tmp_path: pathlib.Path,
) -> None:
    """The walker finds a cycle made through each kind of import it claims to count."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "def f():\n    from pkg.sub import b\n",
        "sub/__init__.py": "from pkg.sub.c import C\n",
        "sub/b.py": "from .. import a\n",
        "sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import d\n",
        "d.py": "from pkg.sub import C\n",
        "e.py": "import pkg.d\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"}  # inside a function; a submodule, not sub/__init__
    assert graph["pkg.sub.b"] == {"pkg.a"}  # relative
    assert graph["pkg.sub.c"] == set()  # under TYPE_CHECKING only
    assert graph["pkg.d"] == {"pkg.sub"}  # a re-export of sub/__init__
    assert graph["pkg.e"] == {"pkg.d"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.a"]]
