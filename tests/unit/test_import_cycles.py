"""No import cycle between checkpointd's modules, counting every import a module makes.

What counts as an edge from module A to module B (A's source, read with ``ast``):
- every ``import B`` / ``from B import x`` in A: at the top, inside functions (lazy
  imports, kept for torch-freeness or start-up time, still tie A to B), and inside
  ``if TYPE_CHECKING:`` blocks. An annotation is a dependency too: a cycle through
  one means neither module can be read, or replaced, without the other; the way out
  is a Protocol in the lower module (read/component_tensors.py's TensorSource).
- ``from P import x`` with P a package: an edge to the submodule ``P.x`` if there is
  one, else to ``P/__init__`` (a real re-export from it). Importing ``P.x`` runs
  ``P/__init__`` too, but that is Python's mechanics, not a dependency: not an edge.
  The root ``__init__`` resolves its public names lazily from a table; its
  TYPE_CHECKING block names the same homes, so its edges are the real lazy ones.
"""

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


def import_graph(src: pathlib.Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports anywhere in its source."""
    modules = _modules(src)
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
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


def test_the_graph_sees_lazy_type_checking_and_package_imports(tmp_path: pathlib.Path) -> None:
    """The walker finds a cycle made through each kind of import it claims to count."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "def f():\n    from pkg.sub import b\n",
        "sub/__init__.py": "from pkg.sub.c import C\n",
        "sub/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import f\n",
        "sub/c.py": "class C: ...\n",
        "d.py": "from pkg.sub import C\n",
        "e.py": "import pkg.d\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"}  # inside a function; a submodule, not sub/__init__
    assert graph["pkg.sub.b"] == {"pkg.a"}  # under TYPE_CHECKING, relative
    assert graph["pkg.d"] == {"pkg.sub"}  # a re-export of sub/__init__
    assert graph["pkg.e"] == {"pkg.d"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.a"]]
