"""The rank zygote (tests/support/zygote.py) starts each rank as ``python -m`` would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.launch import REPO
from tests.support.zygote import ForkedPopen, Zygote, popen, shared


@pytest.fixture
def zygote() -> Zygote:
    """The session's zygote (stopped with the session), as run_ranks and popen use it."""
    return shared()


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


def test_a_forked_popen_has_popens_pipes_signals_and_exit_status(tmp_path: Path) -> None:
    out = tmp_path / "seen.json"
    command = [sys.executable, "-m", "tests.support.zygote_probe", str(out), "echo"]
    env = {**os.environ, "CHECKPOINTD_TEST_PROBE": "piped"}
    proc = popen(
        command,
        env=env,
        cwd=tmp_path,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert isinstance(proc, ForkedPopen)
    assert proc.stdin is not None
    assert proc.stdout is not None
    proc.stdin.write("hello\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == "probe on stdout\n"
    assert proc.stdout.readline() == "HELLO\n"
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    assert proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert err == "probe on stderr\n"
    seen = json.loads(out.read_text())
    assert seen["cwd"] == str(tmp_path)
    assert seen["probe"] == "piped"
    assert seen["argv"] == [str(out), "echo"]
    assert not (tmp_path / "seen.json.atexit").exists()  # killed: no interpreter exit


def test_a_forked_popen_reports_its_exit_code_and_runs_atexit(tmp_path: Path) -> None:
    out = tmp_path / "seen.json"
    command = [sys.executable, "-m", "tests.support.zygote_probe", str(out), "5"]
    with popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        assert proc.wait(60) == 5
    assert (tmp_path / "seen.json.atexit").read_text() == "ran"
    assert json.loads(out.read_text())["torch_loaded"] is True


def test_a_child_whose_import_time_environment_differs_starts_afresh(tmp_path: Path) -> None:
    out = tmp_path / "seen.json"
    command = [sys.executable, "-m", "tests.support.zygote_probe", str(out), "0"]
    threads = "7" if os.environ.get("OMP_NUM_THREADS") != "7" else "5"
    env = {**os.environ, "OMP_NUM_THREADS": threads}
    with popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        assert type(proc) is subprocess.Popen  # torch reads it at import: no fork
        assert proc.wait(120) == 0
    assert json.loads(out.read_text())["torch_loaded"] is False
