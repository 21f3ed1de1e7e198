"""``service="auto"``: the first trainer starts the node's service, detached (its own
session), a lock makes two trainers starting at once end with one service, and a save
after the service died starts a new one."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import checkpointd
from checkpointd.daemon.client.client import status
from checkpointd.daemon.wire.paths import default_socket
from checkpointd.errors import ServiceError
from tests.support.service import auto_socket_env, reap, trainer
from tests.support.service_jobs import expected_state


@pytest.fixture
def auto_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with auto_socket_env(monkeypatch) as socket:
        yield socket


def _pid_of_service(proc_out: str) -> int:
    (line,) = [x for x in proc_out.splitlines() if x.startswith("service pid ")]
    return int(line.split()[-1])


def test_two_trainers_starting_at_once_share_one_detached_service(
    auto_socket: str, tmp_path: Path
) -> None:
    assert default_socket() == auto_socket
    procs = [trainer("auto", str(tmp_path / f"r{i}"), 2) for i in range(2)]
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, err
            outs.append(out)
    finally:
        for proc in procs:
            reap(proc)
    pids = {_pid_of_service(out) for out in outs}
    assert len(pids) == 1
    (pid,) = pids
    assert os.getsid(pid) != os.getsid(0)  # its own session: not in the trainers' group
    assert os.getpgid(pid) != os.getpgid(0)
    parent = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    assert parent != os.getpid()  # not our child: nothing of ours reaps or kills it
    for i in range(2):
        assert [c.step for c in checkpointd.list_checkpoints(str(tmp_path / f"r{i}"))] == [0, 1]
    log = Path(auto_socket).parent / "service.log"
    assert "serving at" in log.read_text()


def test_after_the_service_died_auto_starts_a_new_one(auto_socket: str, tmp_path: Path) -> None:
    root = str(tmp_path / "r")
    with checkpointd.CheckpointWriter(root, service="auto") as writer:
        writer.save(1, {"model": expected_state(1)}).result(60)
    first = status(auto_socket).pid
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _answers(auto_socket):  # every thread gone, the listening socket closed
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with checkpointd.CheckpointWriter(root, service="auto") as writer:
        writer.save(2, {"model": expected_state(2)}).result(60)
    assert status(auto_socket).pid != first
    assert [c.step for c in checkpointd.list_checkpoints(root)] == [1, 2]


def _answers(socket: str) -> bool:
    try:
        status(socket)
    except ServiceError:
        return False
    return True


def test_idle_exit_ends_a_quiet_service(auto_socket: str, tmp_path: Path) -> None:
    os.environ["CHECKPOINTD_IDLE_EXIT"] = "1"
    with checkpointd.CheckpointWriter(str(tmp_path / "r"), service="auto") as writer:
        writer.save(1, {"model": expected_state(1)}).result(60)
        time.sleep(1.5)  # a connected client keeps it alive
        pid = status(auto_socket).pid
    deadline = time.monotonic() + 20
    while os.path.exists(auto_socket) or _answers(auto_socket):
        assert time.monotonic() < deadline, "the idle service did not exit"
        time.sleep(0.1)
    assert "idle for 1" in (Path(auto_socket).parent / "service.log").read_text()
    while _alive(pid):  # the process itself ends, not only its socket
        assert time.monotonic() < deadline, "the idle service did not exit"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
