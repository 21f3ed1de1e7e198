"""Every tunable number lives in tunables.py, documented, and is read at call time.

Static checks over src (no import of the modules scanned): no module binds a tunable
when it is imported (``from checkpointd.tunables import X``, a module or class
attribute, an argument default), no module outside tunables.py defines a number that
looks like a tunable (a constant, a size as a power of two, a pause or timeout given
to a call), and every tunable is read somewhere. Then a few moved tunables are set at
run time and change what the code does.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from checkpointd import tunables

SRC = Path(__file__).resolve().parents[2] / "src" / "checkpointd"

FACTS: dict[tuple[str, str], str] = {
    ("format/codec.py", "_EXT_TENSOR"): "msgpack extension codes: the tree file's format",
    ("format/codec.py", "_EXT_NDARRAY"): "msgpack extension code",
    ("format/codec.py", "_EXT_TUPLE"): "msgpack extension code",
    ("format/codec.py", "_EXT_BIGINT"): "msgpack extension code",
    ("format/codec.py", "_EXT_STATE_DICT"): "msgpack extension code",
    ("format/codec.py", "_EXT_DTYPE"): "msgpack extension code",
    ("format/codec.py", "_EXT_NPSCALAR"): "msgpack extension code",
    ("format/checksum.py", "_POLY"): "the CRC32C polynomial",
    ("daemon/server/peerlink.py", "PEER_PID"): "the admission identity of peer connections",
    ("daemon/wire/peers.py", "NONCE_BYTES"): "the peer handshake's nonce size: its protocol",
    ("daemon/server/priority.py", "LOWEST_NICENESS"): "Linux's lowest CPU priority",
    ("format/layout.py", "STEP_DIGITS"): "step folder names: the format",
    ("format/layout.py", "MAX_STEP"): "follows from STEP_DIGITS",
    ("format/layout.py", "DIRECT_ALIGN"): "O_DIRECT's alignment, written into files",
    ("format/layout.py", "HEADER_ALIGN"): "safetensors' header alignment",
    ("format/header.py", "_INT64_MAX"): "the int64 range",
    ("format/manifest.py", "SCHEMA_VERSION"): "the manifest's schema",
    ("storage/s3upload.py", "MIN_PART_BYTES"): "S3's own multipart limits",
    ("storage/s3upload.py", "MAX_PART_BYTES"): "S3's own multipart limits",
    ("storage/s3upload.py", "MAX_PARTS"): "S3's own multipart limits",
    ("storage/s3upload.py", "MAX_OBJECT_BYTES"): "S3's own object size limit",
    ("state/storable.py", "_MSGPACK_INT_MIN"): "msgpack's int range",
    ("state/storable.py", "_MSGPACK_INT_MAX"): "msgpack's int range",
    ("memory/hostmem.py", "MADV_POPULATE_WRITE"): "a Linux madvise constant",
    ("memory/bytecopy.py", "_WRITABLE"): "CPython's PyBUF_WRITE flag",
    ("read/landing.py", "_ALIGN"): "a cache line: enough for any dtype's alignment",
    ("daemon/server/priority.py", "_WHO_PROCESS"): "Linux ioprio ABI",
    ("daemon/server/priority.py", "_CLASS_BEST_EFFORT"): "Linux ioprio ABI",
    ("daemon/server/priority.py", "_CLASS_IDLE"): "Linux ioprio ABI",
    ("daemon/server/priority.py", "_CLASS_SHIFT"): "Linux ioprio ABI",
}
"""Module-level numbers outside tunables.py that are facts, not choices."""

POWERS_ALLOWED: dict[str, str] = {
    "storage/s3upload.py": "part sizes rounded up to whole MiB (S3 accepts any)",
    "daemon/server/admission.py": "the descriptor count assumed where the limit is unlimited",
    "format/checksum.py": "CRC32C arithmetic over GF(2)",
}
"""Modules whose powers of two from 2**10 to 2**30 are facts, not sizes someone chose."""

TIMED_CALLS = {"sleep", "move_on_after", "fail_after", "wait", "join", "settimeout"}


def _modules() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel != "tunables.py":
            yield rel, ast.parse(path.read_text(), filename=rel)


def _numeric(node: ast.expr) -> bool:
    """Whether ``node`` is a number built only from literals (``8 * 2**20``, ``-1``)."""
    if isinstance(node, ast.Constant):
        return type(node.value) in (int, float)
    if isinstance(node, ast.UnaryOp):
        return _numeric(node.operand)
    if isinstance(node, ast.BinOp):
        return _numeric(node.left) and _numeric(node.right)
    return False


def _reads_tunable(node: ast.AST, *, in_lambdas: bool = False) -> list[str]:
    """The tunables ``node`` reads (not those inside a lambda unless ``in_lambdas``:
    a ``default_factory`` reads them when called)."""
    found, todo = [], [node]
    while todo:
        n = todo.pop()
        if isinstance(n, ast.Lambda) and not in_lambdas:
            continue
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
            found += [n.attr] if n.value.id == "tunables" else []
        todo.extend(ast.iter_child_nodes(n))
    return found


def _bound_at_import(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(line, tunable) for every ``tunables.X`` evaluated when the module is imported:
    at module level, in a class body, in a default or a decorator. A ``DEFAULT_*``
    shown as a public argument's or field's default is the documented exception."""

    def visit(body: list[ast.stmt]) -> Iterator[tuple[int, str]]:
        for stmt in body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                args = stmt.args
                for default in [*args.defaults, *args.kw_defaults, *stmt.decorator_list]:
                    if default is not None:
                        for name in _reads_tunable(default):
                            if not name.startswith("DEFAULT_"):
                                yield stmt.lineno, name
            elif isinstance(stmt, ast.ClassDef):
                for expr in stmt.decorator_list:
                    yield from ((stmt.lineno, n) for n in _reads_tunable(expr))
                for inner in stmt.body:
                    if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                        yield from visit([inner])
                    else:
                        for name in _reads_tunable(inner):
                            if not name.startswith("DEFAULT_"):
                                yield inner.lineno, name
            else:
                nested = [
                    s
                    for s in ast.iter_child_nodes(stmt)
                    if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                ]
                if nested:  # under an if/try at module level
                    yield from visit(nested)
                    continue
                for name in _reads_tunable(stmt):
                    yield stmt.lineno, name

    yield from visit(tree.body)


def test_every_tunable_is_listed_documented_and_a_plain_value() -> None:
    tree = ast.parse((SRC / "tunables.py").read_text())
    names: list[str] = []
    for i, stmt in enumerate(tree.body):
        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
            name = stmt.targets[0].id
            if name == "__all__":
                continue
            names.append(name)
            after = tree.body[i + 1] if i + 1 < len(tree.body) else None
            assert isinstance(after, ast.Expr), f"{name} has no docstring saying why"
            assert isinstance(after.value, ast.Constant), f"{name} has no docstring saying why"
            assert type(getattr(tunables, name)) in (int, float, bool), name
    assert sorted(names) == sorted(tunables.__all__)
    assert len(set(names)) == len(names)


def test_no_module_binds_a_tunable_when_it_is_imported() -> None:
    found = []
    for rel, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "checkpointd.tunables":
                found.append(f"{rel}:{node.lineno}: from checkpointd.tunables import ...")
            if isinstance(node, ast.ImportFrom) and node.module == "checkpointd":
                renamed = [a for a in node.names if a.name == "tunables" and a.asname]
                found += [f"{rel}:{node.lineno}: tunables imported under another name"] * bool(
                    renamed
                )
        found += [f"{rel}:{line}: tunables.{name}" for line, name in _bound_at_import(tree)]
    assert not found, "read these at call time instead:\n" + "\n".join(found)


def test_every_tunable_is_read_by_some_module() -> None:
    read = {name for _, tree in _modules() for name in _reads_tunable(tree, in_lambdas=True)}
    assert read <= set(tunables.__all__), read - set(tunables.__all__)
    assert set(tunables.__all__) - read == set()


def test_no_tunable_looking_number_outside_tunables() -> None:
    found = []
    for rel, tree in _modules():
        scopes: list[list[ast.stmt]] = [tree.body]
        scopes += [c.body for c in ast.walk(tree) if isinstance(c, ast.ClassDef)]
        for body in scopes:
            for stmt in body:
                targets = []
                if isinstance(stmt, ast.Assign) and _numeric(stmt.value):
                    targets = [t.id for t in stmt.targets if isinstance(t, ast.Name)]
                elif isinstance(stmt, ast.AnnAssign) and stmt.value and _numeric(stmt.value):
                    targets = [stmt.target.id] if isinstance(stmt.target, ast.Name) else []
                for name in targets:
                    if name.lstrip("_").isupper() and (rel, name) not in FACTS:
                        found.append(f"{rel}:{stmt.lineno}: {name} = a number")
        units = {  # ``x / 2**20``: a unit to show a number in, not a size
            id(n.right)
            for n in ast.walk(tree)
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div | ast.FloorDiv)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.BinOp) and rel not in POWERS_ALLOWED and id(node) not in units:
                power = isinstance(node.op, ast.Pow) and _numeric(node.right)
                shift = isinstance(node.op, ast.LShift) and _numeric(node.right)
                if (power or shift) and _numeric(node.left):
                    exponent = ast.literal_eval(node.right)
                    # 2**10 to 2**30: a size from a KiB to a GiB (wider: a type's range)
                    if isinstance(exponent, int) and 10 <= exponent <= 30:
                        found.append(f"{rel}:{node.lineno}: a size ({ast.unparse(node)})")
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                given = [*node.args] if called in TIMED_CALLS else []
                given += [k.value for k in node.keywords if k.arg == "timeout"]
                for arg in given:
                    if _numeric(arg) and ast.literal_eval(arg) != 0:
                        found.append(f"{rel}:{node.lineno}: {called}({ast.unparse(arg)})")
            if isinstance(node, ast.arguments):
                named = [*node.posonlyargs, *node.args][-len(node.defaults) or len(node.args) :]
                pairs = [*zip(named, node.defaults, strict=False)]
                pairs += [(a, d) for a, d in zip(node.kwonlyargs, node.kw_defaults, strict=True)]
                for arg, default in pairs:
                    timed = "timeout" in arg.arg or arg.arg.endswith("seconds")
                    if default is not None and timed and _numeric(default):
                        found.append(f"{rel}:{default.lineno}: {arg.arg}={ast.unparse(default)}")
    assert not found, "move these into tunables.py (or list a fact in FACTS):\n" + "\n".join(found)


def test_a_frame_limit_set_at_run_time_applies_to_the_next_frame(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from checkpointd.daemon.wire import protocol

    message = protocol.Lookup(id=1, root="/r" + "x" * 200, storage_options=None, step=1)
    assert protocol.encode(message)
    monkeypatch.setattr(tunables, "MAX_FRAME_BYTES", 100)
    with pytest.raises(protocol.ProtocolError, match="100-byte limit"):
        protocol.encode(message)


def test_part_size_and_spec_limit_set_at_run_time_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    from checkpointd.errors import CheckpointError
    from checkpointd.rebuild.spec import spec
    from checkpointd.storage.fsspec import FsspecStore

    store = FsspecStore("memory://tunables-test")
    monkeypatch.setattr(tunables, "S3_PART_BYTES", 6 * 2**20)
    assert store.block_size == 6 * 2**20
    spec(dict, size=1)
    monkeypatch.setattr(tunables, "MAX_SPEC_BYTES", 8)
    with pytest.raises(CheckpointError, match="more than 8"):
        spec(dict, blob="x" * 64)
