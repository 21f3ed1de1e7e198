"""The public names carry docstrings an API reference can be built from (issue 32): Google
style, each callable's parameters under ``Args:``, what it returns under ``Returns:``, what
it raises under ``Raises:``; dataclasses and structs their fields under ``Attributes:``."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import itertools
import re
import textwrap
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

import checkpointd

SECTIONS = ("Args", "Returns", "Raises", "Attributes", "Yields", "Note", "Example", "Examples")

# Values, not callables: documented by an attribute docstring in their home module.
VALUES = {
    "__version__": "checkpointd._version",
    "LOCAL": "checkpointd.ranks.group",
    "BUILTIN_ALLOW": "checkpointd.rebuild.allowlist",
    "SkippedStep": "checkpointd.read.restore",
}


def sections(doc: str) -> dict[str, str]:
    """The Google-style sections of ``doc``: name -> its indented body."""
    found: dict[str, str] = {}
    current = None
    for line in doc.splitlines():
        header = re.fullmatch(r"([A-Z][a-z]+):", line.strip())
        if header and header[1] in SECTIONS and not line.startswith(" "):
            current = header[1]
            found[current] = ""
        elif current is not None:
            if line and not line.startswith(" "):
                current = None
            else:
                found[current] += line + "\n"
    return found


def entries(body: str) -> list[str]:
    """The names a section lists: its first-level ``name:`` (or ``name (type):``) lines."""
    lines = [line for line in body.splitlines() if line.strip()]
    indent = min((len(line) - len(line.lstrip()) for line in lines), default=0)
    return [
        m[1]
        for line in body.splitlines()
        if line.strip()
        and len(line) - len(line.lstrip()) == indent
        and (m := re.match(r"\s*(\**[A-Za-z_][A-Za-z0-9_]*)(?: \(.+?\))?:", line))
    ]


def raises(fn: Callable[..., Any]) -> bool:
    """Whether ``fn``'s own body raises (a ``raise`` statement of its own)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError):
        return False
    return any(isinstance(node, ast.Raise) for node in ast.walk(tree))


def check_callable(name: str, fn: Callable[..., Any], doc: str, *, must_raise: bool) -> None:
    found = sections(doc)
    signature = inspect.signature(fn)
    params = [p for p in signature.parameters.values() if p.name not in ("self", "cls")]
    if params:
        assert "Args" in found, f"{name}: no Args section"
        listed = [e.lstrip("*") for e in entries(found["Args"])]
        assert listed == [p.name for p in params], f"{name}: Args lists {listed}"
    returned = signature.return_annotation
    if returned not in ("None", None, inspect.Signature.empty):
        key = "Yields" if inspect.isgeneratorfunction(fn) else "Returns"
        assert found.get(key, "").strip(), f"{name}: no {key} section"
    if must_raise or raises(fn):
        listed = entries(found.get("Raises", ""))
        assert listed, f"{name}: no Raises section"
        for error in listed:  # each a real exception class
            home = getattr(checkpointd, error, None) or getattr(__builtins__, error, None)
            if home is None and isinstance(__builtins__, dict):
                home = __builtins__.get(error)
            assert isinstance(home, type), (name, error)
            assert issubclass(home, BaseException), (name, error)


def fields(cls: type) -> list[str]:
    """The fields a dataclass or msgspec struct declares itself (not inherited)."""
    if dataclasses.is_dataclass(cls):
        own = inspect.get_annotations(cls)
        return [f.name for f in dataclasses.fields(cls) if f.init and f.name in own]
    own = inspect.get_annotations(cls)
    return [f for f in cls.__struct_fields__ if f in own]


def members(cls: type) -> list[tuple[str, Any]]:
    """The public methods and properties checkpointd defines on ``cls`` (bases included)."""
    out: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.startswith("checkpointd"):
            continue
        for key, value in vars(klass).items():
            if key.startswith("_") or not (callable(value) or isinstance(value, property)):
                continue
            if isinstance(value, type):
                continue
            out[key] = value
    return sorted(out.items())


def public() -> list[str]:
    return [
        n
        for n in checkpointd.__all__
        if n not in VALUES
        and not (
            isinstance(getattr(checkpointd, n), type)
            and issubclass(getattr(checkpointd, n), BaseException | Warning)
        )
    ]


def check_object(name: str, obj: Any, *, must_raise: bool) -> None:
    """A public function or class, and the public methods checkpointd defines on it."""
    doc = inspect.getdoc(obj) or ""
    assert doc.strip(), f"{name} has no docstring"
    if inspect.isfunction(obj):
        check_callable(name, obj, doc, must_raise=must_raise)
        return
    assert isinstance(obj, type), name
    if dataclasses.is_dataclass(obj) or issubclass(obj, msgspec.Struct):
        listed = entries(sections(doc).get("Attributes", ""))
        assert listed == fields(obj), f"{name}: Attributes lists {listed}, not {fields(obj)}"
        if "__post_init__" in vars(obj) and raises(obj.__post_init__):
            assert entries(sections(doc).get("Raises", "")), f"{name}: no Raises section"
    else:
        init = obj.__init__
        if init is not object.__init__ and init.__module__.startswith("checkpointd"):
            combined = f"{doc}\n{inspect.getdoc(init) or ''}"
            check_callable(f"{name}()", init, combined, must_raise=False)
    for key, member in members(obj):
        if isinstance(member, property):
            assert inspect.getdoc(member), f"{name}.{key} has no docstring"
            continue
        fn = member.__func__ if isinstance(member, classmethod | staticmethod) else member
        member_doc = inspect.getdoc(fn) or ""
        assert member_doc.strip(), f"{name}.{key} has no docstring"
        check_callable(f"{name}.{key}", fn, member_doc, must_raise=False)


@pytest.mark.parametrize("name", public())
def test_each_public_name_documents_its_arguments_returns_and_errors(name: str) -> None:
    check_object(name, getattr(checkpointd, name), must_raise=True)


# The integrations' documented import paths, and the framework each imports.
INTEGRATIONS = {
    "checkpointd.accelerate": "accelerate",
    "checkpointd.lightning": "lightning",
    "checkpointd.torchtitan": "torchtitan",
    "checkpointd.transformers": "transformers",
}


@pytest.mark.parametrize("path", sorted(INTEGRATIONS))
def test_each_integrations_public_name_documents_its_arguments(path: str) -> None:
    pytest.importorskip(INTEGRATIONS[path])
    module = importlib.import_module(path)
    assert module.__all__
    for name in module.__all__:
        check_object(f"{path}.{name}", getattr(module, name), must_raise=False)


@pytest.mark.parametrize(
    "path", ["checkpointd.cli.main", "checkpointd.cli.maintain", "checkpointd.cli.service"]
)
def test_each_cli_command_documents_itself_and_its_exit_status(path: str) -> None:
    """Each command's function (``cmd_X``, ``_cmd_X``) and ``main``: what it runs, its status."""
    module = importlib.import_module(path)
    commands = {
        key: fn
        for key, fn in vars(module).items()
        if inspect.isfunction(fn)
        and fn.__module__ == path
        and (key == "main" or key.lstrip("_").startswith("cmd_"))
    }
    assert commands, path
    for key, fn in commands.items():
        doc = inspect.getdoc(fn) or ""
        if key != "main":
            assert doc.startswith("``checkpointd "), f"{key}: say which command it runs"
        check_callable(f"{path}.{key}", fn, doc, must_raise=False)
        assert "exit status" in sections(doc)["Returns"], key


@pytest.mark.parametrize("name", sorted(VALUES))
def test_each_public_value_has_an_attribute_docstring(name: str) -> None:
    """``NAME = value`` followed by a string where it is defined (what ``help`` cannot show)."""
    assert name in checkpointd.__all__
    module = importlib.import_module(VALUES[name])
    assert getattr(module, name) is getattr(checkpointd, name)
    body = ast.parse(inspect.getsource(module)).body
    documented = False
    for node, following in itertools.pairwise(body):
        targets = [node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            documented = isinstance(following, ast.Expr) and isinstance(
                following.value, ast.Constant
            )
    assert documented, f"{name} in {module.__name__} has no docstring after it"


def test_the_checker_catches_a_missing_argument_and_a_missing_raises() -> None:
    """The checks above are not trivially true: a docstring that skips one is refused."""

    def bad(root: str, step: int) -> int:
        """Do it.

        Args:
            root: The root.

        Returns:
            A number.
        """
        if step < 0:
            raise ValueError(step)
        return step

    with pytest.raises(AssertionError, match="Args lists"):
        check_callable("bad", bad, inspect.getdoc(bad) or "", must_raise=False)
    bad.__doc__ = (bad.__doc__ or "").replace(
        "root: The root.", "root: The root.\n            step: A step."
    )
    with pytest.raises(AssertionError, match="no Raises"):
        check_callable("bad", bad, inspect.getdoc(bad) or "", must_raise=False)
