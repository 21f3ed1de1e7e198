"""``checkpointd ls`` and ``verify`` start without importing torch (it takes seconds)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import checkpointd

SRC = Path(checkpointd.__file__).parent

RUN_TOOLS = """
import sys
from checkpointd.cli import main as cli
root = sys.argv[1]
assert cli.main(["ls", root]) == 0
assert cli.main(["ls", root, "--json"]) == 0
assert cli.main(["verify", root, "--no-progress"]) == 0
assert cli.main(["verify", root, "--all", "--progress"]) == 0
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy"))
assert "torch" not in loaded, loaded[:5]
print("no torch")
"""

# The package without running its __init__: what the cli and the modules it uses import.
BARE_PACKAGE = f"""
import sys, types
package = types.ModuleType("checkpointd")
package.__path__ = [{str(SRC)!r}]
package.__version__ = "0"
sys.modules["checkpointd"] = package
"""


@pytest.fixture
def root(tmp_path: Path) -> str:
    url = str(tmp_path / "ckpt")
    with checkpointd.CheckpointWriter(url) as writer:
        for step in (1, 2):
            writer.save(step, {"m": {"w": torch.ones(8)}}).result(timeout=60)
    return url


def _run(code: str, root: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        [sys.executable, "-c", code, root],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
        env=env,
    )


def test_cli_read_tools_import_no_torch(root: str) -> None:
    """cli, catalog, reader (verify), manifest, storage, cleanup: no torch at module level."""
    done = _run(BARE_PACKAGE + RUN_TOOLS, root)
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("no torch\n")


def test_ls_and_verify_start_without_torch(root: str) -> None:
    done = _run(RUN_TOOLS, root)
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("no torch\n")
