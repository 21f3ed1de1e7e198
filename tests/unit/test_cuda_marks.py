"""Every test that skips without CUDA is marked ``cuda``: benchmarks/gpu_check.py runs
``pytest -m cuda`` on a GPU machine, so an unmarked one would run nowhere."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parents[1]
MARK = "pytest.mark.cuda"


def unmarked(tree: ast.Module) -> list[str]:
    """The test functions of ``tree`` a decorator ties to CUDA (a skip naming cuda, or an
    alias such as ``needs_cuda``) that lack ``pytest.mark.cuda``."""
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            marks = [ast.unparse(d) for d in node.decorator_list]
            if MARK not in marks and any("cuda" in m for m in marks):
                found.append(node.name)
    return found


def test_every_test_that_needs_cuda_is_marked_cuda() -> None:
    found = {
        str(path.relative_to(TESTS)): names
        for path in sorted(TESTS.rglob("test_*.py"))
        if (names := unmarked(ast.parse(path.read_text())))
    }
    assert found == {}


def test_an_unmarked_skip_is_found() -> None:
    source = (
        "@pytest.mark.skipif(not torch.cuda.is_available(), reason='x')\n"
        "def test_a(): ...\n"
        "@needs_cuda\n@pytest.mark.cuda\ndef test_b(): ...\n"
        "@needs_cuda\ndef test_c(): ...\n"
    )
    assert unmarked(ast.parse(source)) == ["test_a", "test_c"]
