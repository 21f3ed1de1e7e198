"""resolve_root: what a root names from this process, spelled so that it names the same
from any other (the checkpoint service), and fixed_root, which the service checks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from checkpointd.daemon.server.memtier import RootKey, root_key
from checkpointd.daemon.wire.protocol import ProtocolError
from checkpointd.storage import fixed_root, resolve_root


@pytest.mark.parametrize(
    ("given", "expected", "fixed"),
    [
        ("ckpt", "{cwd}/ckpt", False),
        ("./a/../ckpt/", "{cwd}/ckpt", False),
        ("~/ckpt", "{home}/ckpt", False),
        ("file://ckpt", "file://{cwd}/ckpt", False),
        ("file:///abs/ckpt/", "file:///abs/ckpt", True),
        ("/abs/ckpt", "/abs/ckpt", True),
        ("s3://bucket/prefix//", "s3://bucket/prefix", True),
        ("memory://", "memory://", True),
    ],
)
def test_a_root_is_resolved_against_this_process(
    given: str, expected: str, fixed: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    want = expected.format(cwd=tmp_path, home=tmp_path / "home")
    assert resolve_root(given) == want
    assert resolve_root(want) == want  # resolving twice changes nothing
    assert fixed_root(want)
    assert fixed_root(given) == fixed


def test_symlinks_are_kept_and_path_objects_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    monkeypatch.chdir(tmp_path)
    assert resolve_root(Path("link")) == str(tmp_path / "link")


def test_the_memory_tiers_key_refuses_relative_roots_and_joins_spellings(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    for relative in ("ckpt", "~/ckpt", "file://ckpt", ""):
        with pytest.raises(ProtocolError, match="is not absolute"):
            root_key(relative, None)
    keys = {root_key(r, None) for r in (f"{tmp_path}/real", f"file://{tmp_path}/link/")}
    assert keys == {RootKey(f"{tmp_path}/real", "{}")}
    assert root_key("s3://b/p/", {"anon": True}) == RootKey("s3://b/p", '{"anon":true}')
