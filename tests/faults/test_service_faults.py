"""The checkpoint service under faults, with real processes, sockets, shared memory and
signals: trainers killed (-9) after save() returned or while copying, the service
killed with saves in flight, hostile clients, foreign users and loose folders."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import checkpointd
from checkpointd.daemon.client.client import Connection, status
from checkpointd.daemon.wire import protocol as p
from checkpointd.daemon.wire.frames import FrameReader
from checkpointd.daemon.wire.paths import check_folder, peer_uid
from checkpointd.errors import ServiceError, ServiceMemoryError
from tests.support import zygote
from tests.support.service import (
    Service,
    child_env,
    reap,
    run_python,
    running_service,
    socket_folder,
    trainer,
)
from tests.support.service_jobs import expected_state


@pytest.fixture
def service() -> Iterator[Service]:
    with running_service() as running:
        yield running


def _wait_for(predicate: object, timeout: float = 30.0) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _committed(root: str) -> list[int]:
    if not os.path.isdir(root):
        return []
    return [c.step for c in checkpointd.list_checkpoints(root)]


def _assert_bit_exact(root: str, step: int) -> None:
    loaded = checkpointd.load(root, step)
    for name, tensor in expected_state(step).items():
        assert torch.equal(loaded.state["model"][name], tensor), (step, name)


@pytest.mark.parametrize("run", range(4))
def test_trainer_killed_after_save_returned_still_commits(
    service: Service, tmp_path: Path, run: int
) -> None:
    chance = random.Random(run)
    root = str(tmp_path / "root")
    kill_after = chance.randrange(0, 6)
    proc = trainer(service.socket, root, 8)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip() == f"returned {kill_after}":
                time.sleep(chance.uniform(0, 0.01))
                proc.send_signal(signal.SIGKILL)
                break
        else:
            raise AssertionError("the trainer ended before that save returned")
    finally:
        err = reap(proc)
    assert proc.returncode == -signal.SIGKILL, err
    returned = set(range(kill_after + 1))
    _wait_for(lambda: returned <= set(_committed(root)))
    _wait_for(lambda: status(service.socket).saves_in_flight == 0)
    for step in _committed(root):
        _assert_bit_exact(root, step)


def test_trainer_killed_while_copying_never_commits_and_memory_is_freed(
    service: Service, tmp_path: Path
) -> None:
    root = str(tmp_path / "root")
    proc = trainer(service.socket, root, 1, "hang-in-copy")
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "copying"
        assert status(service.socket).bytes_staged > 0
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        reap(proc)
    _wait_for(lambda: status(service.socket).bytes_staged == 0)
    reply = status(service.socket)
    assert reply.saves_in_flight == 0
    assert reply.committed == 0
    assert _committed(root) == []


def test_service_killed_with_saves_in_flight_fails_every_handle(tmp_path: Path) -> None:
    gate = str(tmp_path / "gate")
    root = str(tmp_path / "root")
    with running_service(gate=gate) as held:
        writer = checkpointd.CheckpointWriter(root, service=held.socket, max_pending=2)
        handles = [writer.save(step, {"model": expected_state(step)}) for step in (1, 2)]
        assert not any(h.done() for h in handles)
        held.kill()
        started = time.monotonic()
        for handle in handles:
            with pytest.raises(ServiceError, match="did not finish"):
                handle.result(timeout=10)
        assert time.monotonic() - started < 5
        with pytest.raises(ServiceError, match=r"went away|closed the connection"):
            writer.save(3, {"model": expected_state(3)})
        writer.close()  # the failures were seen at result(): nothing left to raise
    assert _committed(root) == []
    for folder in Path(root).glob("*"):
        assert not (folder / "manifest.json").exists()
    assert checkpointd.list_checkpoints(root) == []


def _exchange(sock: socket.socket, payload: bytes, *, half_close: bool = True) -> list[p.Message]:
    """Send raw bytes, then read every message until the service closes the connection."""
    sock.sendall(payload)
    if half_close:
        sock.shutdown(socket.SHUT_WR)
    sock.settimeout(30)
    reader = FrameReader(sock)
    messages: list[p.Message] = []
    while (message := reader.read()) is not None:
        messages.append(message)
    return messages


def _connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    return sock


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


HOSTILE: dict[str, tuple[bytes, bool]] = {
    "garbage": (b"\xff\x00garbage" * 50, False),
    "huge length prefix": (struct.pack(">I", 2**31) + b"x" * 10, False),
    "half a message": (p.encode(p.Status(1))[:-2], True),
    "unknown kind": (_frame(msgspec.msgpack.encode({"kind": "Launch", "id": 1})), False),
    "a reply as a request": (p.encode(p.Ok(3)), False),
    "a segment it does not own": (
        p.encode(
            p.Submit(
                1,
                writer=1,
                segment=10**6,
                snapshot=p.SnapshotDesc(
                    step=1, created_at=p.datetime.now(), components=[], metrics={}, metadata={}
                ),
            )
        ),
        False,
    ),
}


def test_hostile_clients_get_a_typed_error_and_others_are_served(
    service: Service, tmp_path: Path
) -> None:
    results: dict[str, list[p.Message] | BaseException] = {}
    stalled = _connect(service.socket)
    stalled.sendall(p.encode(p.Status(1))[:3])  # stays open, inside a frame

    def attack(name: str, payload: bytes, half_close: bool) -> None:
        try:
            with _connect(service.socket) as sock:
                results[name] = _exchange(sock, payload, half_close=half_close)
        except BaseException as exc:
            results[name] = exc

    threads = [
        threading.Thread(target=attack, args=(name, payload, half))
        for name, (payload, half) in HOSTILE.items()
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    root = str(tmp_path / "root")
    with checkpointd.CheckpointWriter(root, service=service.socket) as writer:
        for step in range(3):
            writer.save(step, {"model": expected_state(step)})
        writer.wait(30)
    for thread in threads:
        thread.join(30)
    stalled.close()
    assert _committed(root) == [0, 1, 2]
    for name in HOSTILE:
        got = results[name]
        assert isinstance(got, list), (name, got)
        assert len(got) == 1, (name, got)
        (error,) = got
        assert isinstance(error, p.Error), (name, error)
        assert error.error == "ProtocolError", (name, error)
    # The service learns that a client closed only when it reads the end of its stream.
    _wait_for(lambda: status(service.socket).clients == 0, 10)
    _assert_bit_exact(root, 2)


def test_another_user_is_refused(service: Service) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to run a client as another user")
    folder = os.path.dirname(service.socket)
    os.chmod(folder, 0o755)  # let the other user reach the socket: the peer check remains
    os.chmod(service.socket, 0o777)
    code = (
        "import os, socket, sys\n"
        "from checkpointd.daemon.wire.frames import FrameReader\n"
        "os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)\n"
        "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
        "r = FrameReader(s); m = r.read(); print(type(m).__name__, m.message); print(r.read())\n"
    )
    out = run_python("-c", code, service.socket, check=True).stdout
    assert out.splitlines() == ["Error this service serves its own user only", "None"]
    os.chmod(folder, 0o700)
    assert status(service.socket).clients == 0


def test_loose_or_foreign_socket_folders_are_refused(tmp_path: Path) -> None:
    folder = socket_folder()
    try:
        os.chmod(folder, 0o755)
        with pytest.raises(ServiceError, match="mode 0755"):
            check_folder(folder)
        out = run_python("-m", "checkpointd", "serve", "--socket", f"{folder}/sock", check=False)
        assert out.returncode == 1
        assert "must be 0700" in out.stderr
        with pytest.raises(ServiceError, match="must be 0700"):
            Connection(f"{folder}/sock")
        if os.getuid() == 0:
            os.chmod(folder, 0o700)
            os.chown(folder, 65534, 65534)
            with pytest.raises(ServiceError, match="owned by uid 65534"):
                check_folder(folder)
    finally:
        os.rmdir(folder)
    left, right = socket.socketpair(socket.AF_UNIX)
    with left, right:
        assert peer_uid(left) == os.getuid()


def test_an_impossible_allocation_is_refused_and_the_connection_lives(service: Service) -> None:
    conn = Connection(service.socket)
    try:
        with pytest.raises(ServiceMemoryError, match="can never fit"):
            conn.request(p.Alloc, nbytes=1 << 50)
        reply, _ = conn.request(p.Status)
        assert isinstance(reply, p.StatusReply)
        assert reply.bytes_staged == 0
    finally:
        conn.close()


def test_a_refused_request_keeps_the_connection(service: Service, tmp_path: Path) -> None:
    conn = Connection(service.socket)
    try:
        with pytest.raises(checkpointd.StorageError, match="storage_options"):
            conn.request(p.OpenWriter, root=str(tmp_path), storage_options={"key": "x"})
        with pytest.raises(checkpointd.InvalidArgumentError):
            conn.request(p.OpenWriter, root=str(tmp_path), newer_steps="sometimes")
        reply, _ = conn.request(p.Status)
        assert isinstance(reply, p.StatusReply)
    finally:
        conn.close()


_FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_VALID = [
    p.encode(p.Status(1))[4:],
    p.encode(p.Alloc(2, nbytes=4096))[4:],
    p.encode(
        p.Submit(
            3,
            writer=1,
            segment=2,
            snapshot=p.SnapshotDesc(
                step=1,
                created_at=p.datetime.now(),
                components=[
                    p.ComponentDesc("m", b"\x80", [p.EntryDesc("w", "F32", [2], 0, 8)], 0, 8)
                ],
                metrics={"loss": 1.0},
                metadata={},
            ),
        )
    )[4:],
]


@_FUZZ
@given(st.binary(max_size=2048))
def test_fuzz_decoding_random_bytes_is_a_protocol_error(data: bytes) -> None:
    with contextlib.suppress(p.ProtocolError):
        p.decode(data)


@_FUZZ
@given(st.sampled_from(_VALID), st.data())
def test_fuzz_decoding_mutated_messages_is_a_protocol_error(
    body: bytes, data: st.DataObject
) -> None:
    raw = bytearray(body)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, max(0, len(raw) - 1)))
        kind = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if kind == "flip" and raw:
            raw[at] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "cut":
            del raw[at:]
        else:
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    try:
        message = p.decode(bytes(raw))
    except p.ProtocolError:
        return
    assert isinstance(message, msgspec.Struct)  # a message of the protocol, nothing else


def test_fuzzed_frames_to_a_live_service_never_break_it(service: Service) -> None:
    chance = random.Random(22)
    for _ in range(40):
        body = bytearray(chance.choice(_VALID))
        for _ in range(chance.randint(1, 4)):
            at = chance.randrange(len(body))
            body[at] ^= 1 << chance.randrange(8)
        frame = struct.pack(">I", len(body)) + bytes(body)
        with _connect(service.socket) as sock:
            replies = _exchange(sock, frame)
        assert all(isinstance(r, p.Message.__args__) for r in replies)  # type: ignore[attr-defined]
    reply = status(service.socket)
    assert reply.clients == 0
    assert reply.bytes_staged == 0


def test_service_killed_after_writing_files_leaves_nothing_visible_and_gc_clears_it(
    tmp_path: Path,
) -> None:
    root = str(tmp_path / "root")
    with running_service(gate=str(tmp_path / "gate"), hold="sync_dir") as held:
        writer = checkpointd.CheckpointWriter(root, service=held.socket)
        handle = writer.save(1, {"model": expected_state(1)})
        folder = Path(root) / f"{1:012d}"
        _wait_for(lambda: len(list(folder.glob("*"))) >= 2)  # tree and tensor files
        held.kill()
        with pytest.raises(ServiceError):
            handle.result(timeout=10)
        writer.close()
    assert not (folder / "manifest.json").exists()
    assert checkpointd.list_checkpoints(root) == []
    done = run_python("-m", "checkpointd", "gc", root, "--apply", "--older-than", "0", check=False)
    assert done.returncode == 0, done.stderr
    assert not folder.exists() or not any(folder.iterdir())


def test_a_sigterm_the_moment_the_socket_appears_stops_the_service_cleanly() -> None:
    # The service handles SIGTERM from before its socket exists: one sent as soon as a
    # client could connect ends it through its own shutdown (exit 0, "stopped"), never by
    # the default action (exit -15, saves in flight dropped). Before, the handler came
    # after the first accepts, and about 1 stop in 4 right after start killed it.
    # At the test's own CPU priority (serve's default niceness +10 gives a service a tenth
    # of a busy core's share: on a loaded machine each of the 8 took 10-28 s to start and
    # stop, past the test's timeout, though every one stopped cleanly).
    for attempt in range(8):
        folder = socket_folder()
        sock = os.path.join(folder, "sock")
        log = Path(folder) / "serve.log"
        with log.open("wb") as out:
            proc = zygote.popen(
                [sys.executable, "-m", "checkpointd", "serve", "--socket", sock, "--niceness", "0"],
                env=child_env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
            )
        try:
            deadline = time.monotonic() + 60
            while not os.path.exists(sock):
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "the service never made its socket"
                time.sleep(0.0005)
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        text = log.read_text()
        shutil.rmtree(folder, ignore_errors=True)
        assert code == 0, f"attempt {attempt}: exit {code}\n{text}"
        assert "stopped" in text, f"attempt {attempt}:\n{text}"
