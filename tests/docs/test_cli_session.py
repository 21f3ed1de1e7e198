"""The console session of docs/cli.md is what the command line prints.

The test replays the page: the demo it names, then every ``$ checkpointd ...`` line of
the page's console block in order (with the two changes the comments describe: a
crashed save's folder two hours old before ``gc``, one flipped bit before the last
``verify``), and compares each output with the page's. What differs from run to run is
masked on both sides: times, the random tokens of file names, CRC32Cs, a float's last
digits, byte counts inside JSON; ``...`` in the page stands for anything, and a line of
the form ``[... ...]`` for any number of lines.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "cli.md"
DEMO = re.compile(r"from\s+`(checkpointd demo [^`]+)`")

_MASKS = [
    (re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(\.\d+)?(Z|\+00:00)?"), "<time>"),
    (re.compile(r"\.[0-9a-f]{8,9}\."), ".<token>."),
    (re.compile(r"\b[0-9a-f]{8}\b"), "<crc>"),
    (re.compile(r"\d\.\d{7,}"), "<float>"),
    (re.compile(r'nbytes": \d+'), 'nbytes": <n>'),
    (re.compile(r"\d+ s old"), "<age> s old"),
    (re.compile(r" +"), " "),
]


def _mask(line: str) -> str:
    for pattern, replacement in _MASKS:
        line = pattern.sub(replacement, line)
    return line.strip()


def _session() -> tuple[str, list[tuple[str, list[str]]]]:
    """The demo command and the (command, expected output lines) of the console block."""
    text = PAGE.read_text()
    demo = DEMO.search(text)
    assert demo, "docs/cli.md no longer names the demo its session starts from"
    block = text.split("```console\n", 1)[1].split("\n```", 1)[0]
    steps: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif line.strip():
            steps[-1][1].append(line)
    return demo.group(1), steps


def _matches(expected: list[str], actual: list[str]) -> bool:
    """Whether ``actual`` fits ``expected``, whose "[... ...]" lines match any lines."""
    if not expected:
        return not actual
    head = _mask(expected[0])
    if head.startswith("[...") and head.endswith("]"):
        return any(_matches(expected[1:], actual[i:]) for i in range(len(actual) + 1))
    if not actual:
        return False
    pattern = ".*".join(re.escape(part) for part in head.split("..."))
    return bool(re.fullmatch(pattern, _mask(actual[0]))) and _matches(expected[1:], actual[1:])


def _crashed_save(root: pathlib.Path) -> None:
    folder = root / "000000000350"
    folder.mkdir()
    (folder / "model.0badf00d.safetensors").write_bytes(b"\0" * 5000)
    old = time.time() - 7202
    for path in (folder / "model.0badf00d.safetensors", folder):
        os.utime(path, (old, old))


def _flip_a_bit(root: pathlib.Path) -> None:
    target = next((root / "000000000300").glob("optimizer.*.safetensors"))
    data = bytearray(target.read_bytes())
    data[len(data) - 100] ^= 0x01
    target.write_bytes(bytes(data))


@pytest.mark.timeout(600)
def test_the_pages_session_is_what_the_command_line_prints(tmp_path: pathlib.Path) -> None:
    demo, steps = _session()
    assert len(steps) >= 8, steps
    env = {
        **os.environ,
        "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONUNBUFFERED": "1",  # stdout and stderr in the order they were written
        "COLUMNS": "200",
    }
    subprocess.run(demo.split(), cwd=tmp_path, env=env, check=True, capture_output=True)
    differences = []
    for command, expected in steps:
        if "a crashed save" in command:
            _crashed_save(tmp_path / "ckpt")
        if "flipping one bit" in command:
            _flip_a_bit(tmp_path / "ckpt")
        done = subprocess.run(
            ["bash", "-c", command],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=120,
            check=False,
        )
        actual = [line for line in done.stdout.splitlines() if line.strip()]
        if not _matches(expected, actual):
            differences.append(f"$ {command}\n--- the page\n" + "\n".join(expected))
            differences[-1] += "\n--- the command line\n" + "\n".join(actual)
    assert differences == [], "\n\n".join(differences)
