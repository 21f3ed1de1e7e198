"""Every Python block of the README and of docs/ is either run here or says why not.

A block is preceded by ``<!-- doc-test: run -->`` (run below, twice in one root, so the
second run takes the resume path) or ``<!-- doc-test: not run: REASON -->`` (a GPU, a
cluster, a framework; the reason names the test that covers it). The runnable blocks
use names a reader has in their own script (``model``, ``optimizer``, ``loader``,
``root``, ...): ``_prelude`` makes small ones of them, and a save "every 500 steps"
becomes every 5, so that the short run here saves and the second run restores.
"""

from __future__ import annotations

import pathlib
import re
import shlex
from typing import Any

import pytest
import torch

import checkpointd

REPO = pathlib.Path(__file__).resolve().parents[2]
_MARK = re.compile(r"^<!-- doc-test: (run|not run: (?P<reason>\S.*\S)) -->$")


def _blocks() -> list[tuple[str, int, str, str]]:
    """(file, line, marker, code) for every ```python block of README.md and docs/."""
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            if not line.startswith("```python"):
                continue
            before = next((text for text in reversed(lines[:number]) if text.strip()), "")
            end = lines.index("```", number + 1)
            code = "\n".join(lines[number + 1 : end])
            found.append((str(path.relative_to(REPO)), number + 1, before, code))
    return found


def test_every_python_block_is_run_or_says_why_not() -> None:
    blocks = _blocks()
    assert len(blocks) >= 10, "the docs' Python blocks were not found"
    unmarked = [f"{file}:{line}" for file, line, mark, _ in blocks if not _MARK.match(mark)]
    assert unmarked == [], "add <!-- doc-test: run --> or <!-- doc-test: not run: why -->"


def _runnable() -> list[Any]:
    return [
        pytest.param(code, id=f"{file}:{line}")
        for file, line, mark, code in _blocks()
        if mark == "<!-- doc-test: run -->"
    ]


def _prelude(root: pathlib.Path) -> dict[str, Any]:
    """Small stand-ins for what a reader's script defines before the block."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
    dataset = torch.utils.data.TensorDataset(torch.randn(640, 4), torch.randn(640, 1))
    generator = torch.Generator().manual_seed(0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True, generator=generator)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return {
        "checkpointd": checkpointd,
        "torch": torch,
        "root": str(root),
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "scaler": torch.amp.GradScaler("cpu"),
        "dataset": dataset,
        "seed": 0,
        "loader": loader,
        "loader_generator": generator,
        "epochs": 2,
        "train_step": train_step,
        "step": 0,
        "batch": torch.randn(1, 4),
    }


@pytest.mark.parametrize("code", _runnable())
def test_runnable_block_runs_and_resumes(code: str, tmp_path: pathlib.Path) -> None:
    root = tmp_path / "ckpt"
    code = code.replace("% 500 ==", "% 5 ==")
    resumes = "restore(" in code
    for _ in range(2 if resumes else 1):  # a second run resumes from the first's checkpoints
        namespace = _prelude(root)
        try:
            exec(compile(code, "<doc block>", "exec"), namespace)
        finally:
            for value in list(namespace.values()):
                if isinstance(value, checkpointd.CheckpointWriter):
                    value.close()
        for value in namespace.values():
            if isinstance(value, checkpointd.SaveHandle):
                value.result(timeout=60)
    saved = checkpointd.list_checkpoints(str(root)) if root.exists() else []
    assert saved or not resumes, "the loop saved nothing"
    for info in saved:  # what the block saved loads back, every byte checked
        checkpointd.load(str(root), info.step)


def _commands() -> list[tuple[str, list[str]]]:
    """Every ``checkpointd ...`` command in a shell block of README.md and docs/, as argv."""
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        block = None  # the info string of the fenced block the line is in
        text = re.sub(r"\\\n\s*", " ", path.read_text())  # a shell line continued with \
        for number, line in enumerate(text.splitlines(), 1):
            if line.startswith("```"):
                block = line[3:].strip() if block is None else None
                continue
            # A console block's commands start with "$ ", its other lines are output.
            command = (
                r"\$ checkpointd " if block == "console" else r"(\$ |\.venv/bin/)?checkpointd "
            )
            if block not in ("", "bash", "console", "text") or not re.match(command, line):
                continue
            if "[" in line or "..." in line:
                continue  # usage lines ("[--socket PATH]", "HOST ...") are not commands
            lexer = shlex.shlex(line.removeprefix("$ "), posix=True, punctuation_chars=True)
            lexer.commenters = "#"
            lexer.whitespace_split = True  # URLs stay whole; &&, ; and | still split
            words: list[str] = []
            for word in [*lexer, ";"]:
                if word in ("&&", ";", "|", "||", "&"):
                    if words and words[0].endswith("checkpointd"):
                        found.append((f"{path.relative_to(REPO)}:{number}", words[1:]))
                    words = []
                elif not word.startswith("$"):  # $VARS of the shell around it
                    words.append(word)
    return found


def test_every_command_shown_is_one_the_parser_accepts() -> None:
    from checkpointd.cli.parser import build_parser

    commands = _commands()
    assert len(commands) >= 15, commands
    refused = []
    for where, argv in commands:
        try:
            build_parser().parse_args(argv)
        except SystemExit:
            refused.append(f"{where}: checkpointd {' '.join(argv)}")
    assert refused == []
