"""The rank zygote (tests/support/zygote.py) starts each rank as ``python -m`` would."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.launch import REPO
from tests.support.zygote import Zygote


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    forks = Zygote()
    yield forks
    forks.stop()


def test_a_forked_rank_runs_as_main_with_its_argv_env_cwd_and_logs(
    zygote: Zygote, tmp_path: Path
) -> None:
    out = tmp_path / "seen.json"
    env = {"CHECKPOINTD_TEST_PROBE": "here"}
    pid = zygote.start("tests.support.zygote_probe", [str(out), "3"], env, tmp_path / "err.txt")
    assert zygote.wait(pid, 60) == 3
    seen = json.loads(out.read_text())
    assert seen == {
        "argv": [str(out), "3"],
        "name": "__main__",
        "cwd": str(REPO),
        "probe": "here",
        "torch_loaded": True,  # paid once, in the zygote
    }
    assert (tmp_path / "err.txt").read_text() == "probe on stderr\n"
    assert (tmp_path / "seen.json.atexit").read_text() == "ran"  # a normal interpreter exit


def test_a_hanging_rank_is_killed_and_reaped(zygote: Zygote, tmp_path: Path) -> None:
    out = tmp_path / "seen.json"
    pid = zygote.start("tests.support.zygote_probe", [str(out), "hang"], {}, tmp_path / "e")
    assert zygote.wait(pid, 0.5) is None
    zygote.kill(pid)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_an_uncaught_exception_exits_1_with_its_traceback(zygote: Zygote, tmp_path: Path) -> None:
    pid = zygote.start("tests.support.zygote_probe", [], {}, tmp_path / "err.txt")
    assert zygote.wait(pid, 60) == 1
    assert "IndexError" in (tmp_path / "err.txt").read_text()
