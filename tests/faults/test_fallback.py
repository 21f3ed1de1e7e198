"""With ``step=None``, load and restore fall back to the newest checkpoint that verifies.

Each damaged newer step is skipped with a CheckpointWarning naming it and why,
and listed in ``skipped_steps``; an explicit step keeps damage an error; when
every step is damaged the error says so and live objects are left untouched.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import checkpointd
from checkpointd.errors import CheckpointWarning, CorruptCheckpointError
from checkpointd.format.manifest import MANIFEST_NAME, step_dirname
from tests.faults.helpers import make_state, same


def _save(root: Path, steps: list[int]) -> dict[int, dict[str, Any]]:
    states = {step: make_state(step) for step in steps}
    with checkpointd.CheckpointWriter(str(root)) as writer:
        for step, state in states.items():
            writer.save(step, state)
        writer.wait()
    return states


def _tensor_file(root: Path, step: int) -> Path:
    folder = root / step_dirname(step)
    return max(
        (p for p in folder.iterdir() if p.name != MANIFEST_NAME and p.stat().st_size > 1000),
        key=lambda p: p.stat().st_size,
    )


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_load_falls_back_past_a_flipped_byte(tmp_path: Path) -> None:
    states = _save(tmp_path, [1, 2, 3])
    _flip_byte(_tensor_file(tmp_path, 3))
    with pytest.warns(CheckpointWarning, match=r"step 3.*CRC32C"):
        loaded = checkpointd.load(str(tmp_path))
    assert loaded.info.step == 2
    assert same(loaded.state, states[2])
    assert [s for s, _ in loaded.skipped_steps] == [3]
    assert "CRC32C" in loaded.skipped_steps[0][1]


def test_explicit_step_keeps_damage_an_error(tmp_path: Path) -> None:
    _save(tmp_path, [1, 2])
    _flip_byte(_tensor_file(tmp_path, 2))
    with pytest.raises(CorruptCheckpointError, match="CRC32C"):
        checkpointd.load(str(tmp_path), 2)
    model = torch.nn.Linear(3, 3)
    with pytest.raises(CorruptCheckpointError):
        checkpointd.restore(str(tmp_path), {"model": model}, step=2, strict=False)


def test_missing_file_and_truncated_file_are_skipped(tmp_path: Path) -> None:
    states = _save(tmp_path, [1, 2, 3])
    _tensor_file(tmp_path, 3).unlink()
    victim = _tensor_file(tmp_path, 2)
    victim.write_bytes(victim.read_bytes()[:-7])
    with pytest.warns(CheckpointWarning) as record:
        loaded = checkpointd.load(str(tmp_path))
    assert loaded.info.step == 1
    assert same(loaded.state, states[1])
    assert [s for s, _ in loaded.skipped_steps] == [3, 2]
    assert "missing" in loaded.skipped_steps[0][1]
    assert "size" in loaded.skipped_steps[1][1]
    assert len([w for w in record if issubclass(w.category, CheckpointWarning)]) == 2


def test_damaged_manifest_is_recorded_too(tmp_path: Path) -> None:
    _save(tmp_path, [1, 2])
    (tmp_path / step_dirname(2) / MANIFEST_NAME).write_bytes(b"{not json")
    with pytest.warns(CheckpointWarning, match="step 2"):
        loaded = checkpointd.load(str(tmp_path))
    assert loaded.info.step == 1
    assert [s for s, _ in loaded.skipped_steps] == [2]


class _Holder:
    """A stateful target holding the three components' trees as plain tensors."""

    def __init__(self) -> None:
        self.value: dict[str, Any] = {"w": torch.zeros(256, 4), "b": torch.zeros(256)}

    def state_dict(self) -> dict[str, Any]:
        return self.value

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = {k: v.clone() for k, v in state.items()}


def test_restore_falls_back_and_reports_the_skip(tmp_path: Path) -> None:
    states = _save(tmp_path, [1, 2])
    _flip_byte(_tensor_file(tmp_path, 2))
    holder = _Holder()
    with pytest.warns(CheckpointWarning, match="step 2"):
        info = checkpointd.restore(str(tmp_path), {"model": holder}, strict=False)
    assert info.step == 1
    assert info.restored == ("model",)
    assert [s for s, _ in info.skipped_steps] == [2]
    assert same(holder.value, states[1]["model"])


def test_all_damaged_is_an_error_and_touches_nothing(tmp_path: Path) -> None:
    _save(tmp_path, [1, 2])
    for step in (1, 2):
        _flip_byte(_tensor_file(tmp_path, step))
    holder = _Holder()
    before = {k: v.clone() for k, v in holder.value.items()}
    with pytest.raises(CorruptCheckpointError, match=r"no checkpoint .* verifies.*step 2.*step 1"):
        checkpointd.restore(str(tmp_path), {"model": holder}, strict=False)
    assert same(holder.value, before)
    with pytest.raises(CorruptCheckpointError, match="verifies"):
        checkpointd.load(str(tmp_path))


def test_ls_verify_marks_damaged_steps(tmp_path: Path) -> None:
    _save(tmp_path, [1, 2])
    _flip_byte(_tensor_file(tmp_path, 2))
    cli = [sys.executable, "-m", "checkpointd", "ls", str(tmp_path), "--verify"]
    text = subprocess.run(cli, capture_output=True, text=True, check=False, timeout=60)
    assert text.returncode == 1, text.stderr
    lines = {line.split()[0]: line for line in text.stdout.splitlines()[1:] if line.strip()}
    assert "DAMAGED" in lines["2"]
    assert "CRC32C" in lines["2"]
    assert "DAMAGED" not in lines["1"]
    raw = subprocess.run([*cli, "--json"], capture_output=True, text=True, check=False, timeout=60)
    rows = {row["step"]: row for row in json.loads(raw.stdout)}
    assert rows[1]["damaged"] == []
    assert rows[2]["damaged"]
