"""The sessions the docs show are what the command line prints.

docs/cli.md's console session: the test replays the page: the demo it names, then every ``$ checkpointd ...`` line of
the page's console block in order (with the two changes the comments describe: a
crashed save's folder two hours old before ``gc``, one flipped bit before the last
``verify``), and compares each output with the page's. What differs from run to run is
masked on both sides: times, the random tokens of file names, CRC32Cs, a float's last
digits, byte counts inside JSON; ``...`` in the page stands for anything, and a line of
the form ``[... ...]`` for any number of lines. The sessions of docs/specs.md and
docs/foreign.md are replayed the same way on a checkpoint with specs (sizes masked too:
the page does not say how many steps trained it), their ``>>>`` lines evaluated in
Python.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

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
    return demo.group(1), _steps(block)


def _steps(block: str) -> list[tuple[str, list[str]]]:
    """The ("$ command" or ">>> expression", expected output lines) of a shown session."""
    steps: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith(("$ ", ">>> ")):
            steps.append((line, []))
        elif line.strip() and steps:
            steps[-1][1].append(line)
    return steps


def _shown_sessions(page: pathlib.Path) -> list[tuple[str, list[str]]]:
    """Every step of the fenced blocks of ``page`` that start with "$ " or ">>> "."""
    steps = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", page.read_text(), re.S | re.M):
        if block.startswith(("$ checkpointd", ">>> ")):
            steps += _steps(block)
    return steps


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
    env = _environment()
    subprocess.run(demo.split(), cwd=tmp_path, env=env, check=True, capture_output=True)
    differences = _replay(steps, tmp_path, env)
    assert differences == [], "\n\n".join(differences)


def _environment() -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONUNBUFFERED": "1",  # stdout and stderr in the order they were written
        "COLUMNS": "200",
    }


def _replay(
    steps: list[tuple[str, list[str]]],
    cwd: pathlib.Path,
    env: dict[str, str],
    python: dict[str, Any] | None = None,
    mask: Callable[[str], str] = lambda line: line,
) -> list[str]:
    """Run each step in ``cwd``; the steps whose output does not fit the page's."""
    differences = []
    for command, expected in steps:
        if "a crashed save" in command:
            _crashed_save(cwd / "ckpt")
        if "flipping one bit" in command:
            _flip_a_bit(cwd / "ckpt")
        if command.startswith(">>> "):
            assert python is not None, command
            actual = [_evaluate(command[4:], python)]
        else:
            done = subprocess.run(
                ["bash", "-c", command[2:]],
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=120,
                check=False,
            )
            actual = [line for line in done.stdout.splitlines() if line.strip()]
        if not _matches([mask(line) for line in expected], [mask(line) for line in actual]):
            differences.append(f"{command}\n--- the page\n" + "\n".join(expected))
            differences[-1] += "\n--- what it printed\n" + "\n".join(actual)
    return differences


def _evaluate(expression: str, namespace: dict[str, Any]) -> str:
    """What the Python prompt shows for ``expression``: its repr, or the error's line."""
    try:
        return repr(eval(expression, namespace))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


_SIZE = re.compile(r"\d+(\.\d+)? (B|KiB|MiB)\b")


def _spec_checkpoint(root: pathlib.Path) -> None:
    """What the specs and foreign-format pages start from: step 100 with three specs."""
    import checkpointd
    from tests.support.specmodels import Net

    torch = pytest.importorskip("torch")
    model = Net(8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    specs = {
        "model": checkpointd.spec(Net, 8),
        "optimizer": checkpointd.spec(torch.optim.AdamW, lr=1e-3),
        "scheduler": checkpointd.spec(torch.optim.lr_scheduler.StepLR, step_size=10),
    }
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    with checkpointd.CheckpointWriter(str(root)) as writer:
        writer.save(100, state, specs=specs).result(timeout=60)


@pytest.mark.timeout(300)
def test_the_spec_and_foreign_sessions_are_what_they_print(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import checkpointd

    steps = _shown_sessions(REPO / "docs" / "specs.md")
    steps += _shown_sessions(REPO / "docs" / "foreign.md")
    assert len(steps) >= 7, steps
    _spec_checkpoint(tmp_path / "ckpt")
    monkeypatch.chdir(tmp_path)  # the >>> lines name the root "ckpt"
    python = {"checkpointd": checkpointd}
    differences = _replay(
        steps, tmp_path, _environment(), python, lambda line: _SIZE.sub("<size>", line)
    )
    assert differences == [], "\n\n".join(differences)
