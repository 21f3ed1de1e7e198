"""Mark each collected test with the kinds of cost it carries, so a loop can pick a tier.

The kinds (registered in pyproject.toml): ``ranks`` (a multi-rank subprocess job),
``service`` (a service process), ``cloud`` (an S3, GCS or Azure emulator), ``frameworks``
(Lightning, Accelerate, Transformers or torchtitan), ``bench`` (the benchmark smokes),
``docs`` (the documentation site built and read in a browser: every test under tests/docs).
A test gets a kind when its function, one of its fixtures, or any function of tests/ that
those reach (by name, through module attributes too) refers to what starts that cost, so
new tests are marked without a list to keep. The fast tier is every test with none of them:

    pytest -m "not (slow or ranks or service or cloud or frameworks or bench or containers or docs)"
"""

from __future__ import annotations

import importlib
import inspect
import re
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest

KINDS = ("ranks", "service", "cloud", "frameworks", "bench", "docs")

# What starts the cost: functions of tests/support (module.name) and session fixtures.
_L, _S = "tests.support.launch.", "tests.support.service."
_STARTS: dict[str, frozenset[str]] = {
    "ranks": frozenset(
        {_L + "run_ranks", _L + "start_ranks", _L + "hosted_store", _S + "rank_processes"}
    ),
    "service": frozenset(
        _S + name for name in ("start_service", "running_service", "services_per_rank", "trainer")
    )
    | {_S + "socket_folder"},
    "cloud": frozenset(
        {
            "moto_s3",
            "s3rver",
            "fake_gcs",
            "gcs_emulator",
            "azurite",
            "tests.support.s3.start_moto",
            "tests.support.s3rver.start_s3rver",
            "tests.support.azurite.start_azurite",
            "tests.support.gcs.start_fake_gcs_server",
            "tests.support.gcs.start_gcp_storage_emulator",
        }
    ),
}
# Root kinds served by an emulator, as parametrize values of ``*_root`` fixtures.
_CLOUD_PARAMS = frozenset({"s3", "s3rver", "gcs", "gcsemu", "azure"})
_FRAMEWORKS = frozenset(
    {"lightning", "pytorch_lightning", "accelerate", "transformers", "torchtitan"}
)
_FRAMEWORK_TEXT = re.compile(
    r"^(lightning|pytorch_lightning|accelerate|transformers|torchtitan)(\.|$)"
    r"|^tests\.support\.(lightning|lightning_kill|accelerate|transformers|torchtitan)_job$"
)
_BENCH_PREFIX = "test_benchmarks"  # test_benchmarks_smoke.py, test_benchmarks_compare.py, ...
_DOCS_FOLDER = "docs"  # tests/docs: the site, built with mkdocs and read in Chromium


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _module(name: str) -> types.ModuleType | None:
    """The module of tests/ called ``name`` (imported if it is not yet), else None."""
    if not name.startswith("tests."):
        return None
    try:
        return importlib.import_module(name)
    except (Exception, pytest.skip.Exception):
        return None


def _ours(value: object) -> bool:
    return str(getattr(value, "__module__", "") or "").startswith("tests.")


class _Scan:
    """Which names and strings a function reaches through the functions of tests/."""

    def __init__(self) -> None:
        self._memo: dict[object, tuple[frozenset[str], frozenset[str]]] = {}

    def reach(self, func: Callable[..., Any]) -> tuple[frozenset[str], frozenset[str]]:
        func = inspect.unwrap(func)
        key = getattr(func, "__code__", None) or func
        if key in self._memo:
            return self._memo[key]
        self._memo[key] = (frozenset(), frozenset())  # a cycle adds nothing
        names: set[str] = set()
        texts: set[str] = set()
        code = getattr(func, "__code__", None)
        glob: dict[str, Any] = getattr(func, "__globals__", {})
        if code is not None:
            for part in _codes(code):
                names.update(part.co_names)
                texts.update(c for c in part.co_consts if isinstance(c, str) and len(c) < 80)
        found: list[object] = []
        modules = [
            vars(glob[n])
            for n in names
            if isinstance(glob.get(n), types.ModuleType) and glob[n].__name__.startswith("tests.")
        ]
        # Function-level ``from tests.x import y``: the module's name is among the names.
        modules += [vars(m) for m in map(_module, names) if m is not None]
        for name in names:
            value = glob.get(name)
            if isinstance(value, types.ModuleType):
                texts.add(value.__name__)
            elif isinstance(value, str):
                texts.add(value)
            elif value is not None:
                found.append(value)
            found.extend(m[name] for m in modules if name in m)
        for value in found:
            if not _ours(value):
                continue
            if inspect.isclass(value):
                members = [v for v in vars(value).values() if inspect.isfunction(v)]
            elif inspect.isfunction(value):
                members = [inspect.unwrap(value)]
            else:
                continue
            for member in members:
                names.add(f"{member.__module__}.{member.__qualname__}")
                more_names, more_texts = self.reach(member)
                names |= more_names
                texts |= more_texts
        result = (frozenset(names), frozenset(texts))
        self._memo[key] = result
        return result


def _fixture_funcs(item: pytest.Item) -> Iterator[Callable[..., Any]]:
    info = getattr(item, "_fixtureinfo", None)
    for defs in getattr(info, "name2fixturedefs", {}).values():
        for fixturedef in defs:
            yield fixturedef.func


def kinds_of(item: pytest.Item, scan: _Scan) -> set[str]:
    """The kinds of cost ``item`` carries."""
    names: set[str] = set(getattr(item, "fixturenames", ()))
    texts: set[str] = set()
    funcs = [getattr(item, "function", None), *_fixture_funcs(item)]
    for func in funcs:
        if func is not None:
            more_names, more_texts = scan.reach(func)
            names |= more_names
            texts |= more_texts
    kinds = {kind for kind, starts in _STARTS.items() if names & starts}
    callspec = getattr(item, "callspec", None)
    params = getattr(callspec, "params", {}).values()
    if any(isinstance(v, str) and v in _CLOUD_PARAMS for v in params):
        kinds.add("cloud")
    if names & _FRAMEWORKS or any(_FRAMEWORK_TEXT.match(t) for t in texts):
        kinds.add("frameworks")
    if item.path.name.startswith(_BENCH_PREFIX):
        kinds.add("bench")
    if item.path.parent.name == _DOCS_FOLDER and item.path.parent.parent.name == "tests":
        kinds.add("docs")
    return kinds


def mark_kinds(items: list[pytest.Item]) -> None:
    """Add a marker per kind to each of ``items`` (from pytest_collection_modifyitems)."""
    scan = _Scan()
    for item in items:
        for kind in sorted(kinds_of(item, scan)):
            item.add_marker(getattr(pytest.mark, kind))
