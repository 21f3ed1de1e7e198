"""What a user's mypy --strict sees of the package root: every public name, typed."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

import checkpointd

SRC = pathlib.Path(checkpointd.__file__).parent


def test_mypy_sees_every_public_name_with_its_type(tmp_path: pathlib.Path) -> None:
    """What a user's mypy --strict sees: each name importable (re-exported) and typed.
    A name missing from __init__'s TYPE_CHECKING block would be Any (through the
    module's __getattr__), a derived __all__ seen by mypy an export error."""
    pytest.importorskip("mypy")
    names = sorted(checkpointd.__all__)
    probe = tmp_path / "probe.py"
    probe.write_text(
        f"from checkpointd import {', '.join(names)}\n"
        + "".join(f"reveal_type({n})\n" for n in names)
    )
    # MYPYPATH: this checkout's package, whatever the environment has installed.
    env = {**os.environ, "MYPYPATH": str(SRC.parent)}
    command = [sys.executable, "-m", "mypy", "--strict", "--cache-dir", "cache", "probe.py"]
    done = subprocess.run(
        command, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100
    )
    out = done.stdout + done.stderr
    lines = out.splitlines()
    revealed = [line for line in lines if "Revealed type is" in line]
    assert len(revealed) == len(names), out
    assert not [line for line in revealed if '"Any"' in line], out
    assert not [line for line in lines if ": error:" in line], out
