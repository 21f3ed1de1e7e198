"""A real ``checkpointd serve`` against hostile clients that send crafted frames on raw
sockets: frames nested too deep, frames of millions of objects, many large frames held
open, more connections or segments than the service has file descriptors. Each time the
service goes on serving a well-behaved client, promptly, within bounded memory."""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
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

import checkpointd
from checkpointd.daemon.client.client import status
from checkpointd.daemon.wire import protocol as p
from checkpointd.daemon.wire.frames import FrameReader
from tests.support.service import (
    REPO,
    Service,
    child_env,
    run_python,
    running_service,
    socket_folder,
    wait_answers,
)
from tests.support.service_jobs import expected_state

MiB = 1 << 20


def _enc(value: object) -> bytes:
    return msgspec.msgpack.encode(value)


def _connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    return sock


def _replies(sock: socket.socket, seconds: float = 30) -> list[p.Message]:
    """Every message until the service closes the connection (fds received closed)."""
    sock.settimeout(seconds)
    reader = FrameReader(sock)
    messages: list[p.Message] = []
    try:
        while (message := reader.read()) is not None:
            messages.append(message)
    finally:
        reader.close()
    return messages


def _open_writer_with(options: bytes) -> bytes:
    """The body of an OpenWriter whose storage_options' one value is ``options``
    (raw msgpack)."""
    return (
        b"\x84"
        + _enc("kind")
        + _enc("OpenWriter")
        + _enc("id")
        + _enc(1)
        + _enc("root")
        + _enc("/tmp/nowhere")
        + _enc("storage_options")
        + b"\x81"
        + _enc("a")
        + options
    )


def _submit_with(elements: int) -> bytes:
    """The start of a Submit body whose snapshot's metadata maps one key to an array of
    ``elements``; the caller appends them (``b"\x90"``: an empty array)."""
    return (
        b"\x85"
        + _enc("kind")
        + _enc("Submit")
        + _enc("id")
        + _enc(1)
        + _enc("writer")
        + _enc(1)
        + _enc("segment")
        + _enc(1)
        + _enc("snapshot")
        + b"\x81"
        + _enc("metadata")
        + b"\x81"
        + _enc("a")
        + b"\xdd"
        + struct.pack(">I", elements)
    )


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _status_in_another_process(socket_path: str) -> dict[str, object]:
    out = run_python("-m", "checkpointd", "status", "--socket", socket_path, "--json", check=True)
    decoded = msgspec.json.decode(out.stdout)
    assert isinstance(decoded, dict)
    return decoded


def _save_in_another_process(socket_path: str, root: str) -> None:
    code = (
        "import sys, checkpointd\n"
        "from tests.support.service_jobs import expected_state\n"
        "with checkpointd.CheckpointWriter(sys.argv[2], service=sys.argv[1]) as w:\n"
        "    w.save(1, {'model': expected_state(1)}).result(60)\n"
    )
    done = run_python("-c", code, socket_path, root, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = checkpointd.load(root, 1)
    for name, tensor in expected_state(1).items():
        assert loaded.state["model"][name].equal(tensor), name


def _rss(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)


class _StatusProbe:
    """Asks for Status on a connection of its own, again and again, in a thread, keeping
    the longest wait for an answer."""

    def __init__(self, socket_path: str) -> None:
        self.sock = _connect(socket_path)
        self.sock.settimeout(60)
        self.reader = FrameReader(self.sock)
        self.longest = 0.0
        self.answers = 0
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                self.sock.sendall(p.encode(p.Status(self.answers + 1)))
                reply = self.reader.read()
                assert isinstance(reply, p.StatusReply), reply
                self.longest = max(self.longest, time.monotonic() - started)
                self.answers += 1
                time.sleep(0.02)
        except BaseException as exc:
            self.failure = exc

    def __enter__(self) -> _StatusProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)
        self.reader.close()
        self.sock.close()


@pytest.fixture
def service() -> Iterator[Service]:
    with running_service() as running:
        yield running


# -- item 2: a frame nested too deep ------------------------------------------------------


def test_a_deeply_nested_frame_ends_its_connection_only(service: Service, tmp_path: Path) -> None:
    body = _open_writer_with(b"\x91" * 5000 + b"\x90")  # 5,000 nested one-element arrays
    assert len(body) < 6000
    for _ in range(3):
        with _connect(service.socket) as sock:
            sock.sendall(_frame(body))
            replies = _replies(sock)
        assert len(replies) == 1, replies
        (error,) = replies
        assert isinstance(error, p.Error), error
        assert error.error == "ProtocolError"
        assert "deeper than" in error.message
    assert service.proc.poll() is None, service.log_text()[-3000:]
    _save_in_another_process(service.socket, str(tmp_path / "root"))
    reply = status(service.socket)
    assert reply.clients == 0
    assert reply.refused.get("frames") == 3


# -- item 7: one frame of tens of millions of objects ----------------------------------------


def test_a_frame_of_millions_of_objects_is_refused_without_stalling_others(
    service: Service,
) -> None:
    count = 24 * MiB  # 24 M empty arrays, a 24 MiB frame: seconds and GBs to decode
    submit = _frame(_submit_with(count) + b"\x90" * count)
    options = _frame(_open_writer_with(b"\xdd" + struct.pack(">I", 4 * MiB) + b"\x90" * 4 * MiB))
    peak = _rss(service.proc.pid, "VmHWM")
    got: dict[str, list[p.Message] | str] = {}
    with _StatusProbe(service.socket) as probe:
        for frame, why in ((submit, "objects"), (options, "limit is")):
            with _connect(service.socket) as sock:
                sock.settimeout(60)
                try:
                    sock.sendall(frame)
                    got[why] = _replies(sock, 60)
                except (BrokenPipeError, ConnectionResetError):
                    # Refused from its first bytes: closed with the rest unread, which
                    # may reset the connection before the client reads the error.
                    assert why == "limit is"
                except TimeoutError:
                    got[why] = "no answer in 60 s"
        time.sleep(0.3)
    assert probe.failure is None, probe.failure
    assert probe.longest < 2.0, f"Status waited {probe.longest:.1f}s"
    assert probe.answers > 5
    grown = _rss(service.proc.pid, "VmHWM") - peak
    assert grown < 400 * MiB, f"the service's peak memory grew {grown / MiB:.0f} MiB"
    assert service.proc.poll() is None
    for why, replies in got.items():
        assert isinstance(replies, list), replies
        assert len(replies) == 1, replies
        (error,) = replies
        assert isinstance(error, p.Error), error
        assert error.error == "ProtocolError"
        assert why in error.message, error.message


# -- item 8: many large frames held open, one byte short ------------------------------------


def test_large_frames_held_open_are_bounded_and_others_are_served(tmp_path: Path) -> None:
    conns, length = 12, 60 * MiB
    body_start = _submit_with(length)  # a Submit's first bytes, then filler
    frame_start = struct.pack(">I", length) + body_start
    with running_service("--memory-limit", "256M") as service:
        before = _rss(service.proc.pid)
        socks = [_connect(service.socket) for _ in range(conns)]
        try:
            sent = [0] * conns
            chunk = frame_start + b"\x90" * (MiB - len(frame_start))
            filler = b"\x90" * MiB
            for sock in socks:
                sock.setblocking(False)
            quiet_since = time.monotonic()
            while time.monotonic() - quiet_since < 1.5:
                progress = False
                for i, sock in enumerate(socks):
                    left = 4 + length - 1 - sent[i]  # all but the frame's last byte
                    if left <= 0:
                        continue
                    data = chunk if sent[i] == 0 else filler
                    try:
                        sent[i] += sock.send(data[: min(len(data), left)])
                        progress = True
                    except BlockingIOError:
                        pass
                if progress:
                    quiet_since = time.monotonic()
                else:
                    time.sleep(0.05)
            grown = _rss(service.proc.pid) - before
            taken = sum(sent)
            with _StatusProbe(service.socket) as probe:
                time.sleep(1.0)
            assert probe.failure is None, probe.failure
            assert probe.answers > 3
            assert probe.longest < 2.0, f"Status waited {probe.longest:.1f}s"
        finally:
            for sock in socks:
                sock.close()
        assert grown < 400 * MiB, f"{taken / MiB:.0f} MiB sent; RSS grew {grown / MiB:.0f} MiB"
        assert taken < conns * length // 2, f"the service took {taken / MiB:.0f} MiB"
        _save_in_another_process(service.socket, str(tmp_path / "root"))
        assert service.proc.poll() is None


# -- item 3: out of file descriptors ------------------------------------------------------------


@contextlib.contextmanager
def _service_with_descriptors(limit: int) -> Iterator[Service]:
    """``checkpointd serve`` whose RLIMIT_NOFILE (soft and hard) is ``limit``."""

    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    folder = socket_folder()
    path = os.path.join(folder, "sock")
    log = Path(folder) / "serve.log"
    try:
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "checkpointd", "serve", "--socket", path],
                env=child_env(),
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                preexec_fn=lower,  # noqa: PLW1509 - only setrlimit, before exec
            )
        running = Service(proc, path, log)
        try:
            wait_answers(path, proc=proc)
            yield running
        finally:
            running.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_more_connections_than_descriptors_keep_the_service_serving(tmp_path: Path) -> None:
    with _service_with_descriptors(64) as service:
        socks: list[socket.socket] = []
        try:
            for _ in range(150):  # more than its 64 descriptors, all from this process
                socks.append(_connect(service.socket))
            time.sleep(0.5)
            assert service.proc.poll() is None, service.log_text()[-3000:]
            reply = _status_in_another_process(service.socket)
            refused = reply["refused"]
            assert isinstance(refused, dict)
            assert refused.get("connections", 0) > 0, reply
            _save_in_another_process(service.socket, str(tmp_path / "root"))
            for sock in socks[-5:]:  # the refused ones were told why, then closed
                replies = _replies(sock, 10)
                assert [type(m) for m in replies] == [p.Error], replies
                assert isinstance(replies[0], p.Error)
                assert "connections" in replies[0].message
        finally:
            for sock in socks:
                sock.close()
        assert service.proc.poll() is None, service.log_text()[-3000:]


def test_one_byte_segments_are_capped_and_count_a_page(tmp_path: Path) -> None:
    with _service_with_descriptors(64) as service:
        sock = _connect(service.socket)
        try:
            asks = 120  # one memfd each: more than its 64 descriptors
            sock.sendall(b"".join(p.encode(p.Alloc(i + 1, nbytes=1)) for i in range(asks)))
            sock.settimeout(30)
            reader = FrameReader(sock)
            got: list[p.Message] = []
            try:
                while len(got) < asks:
                    message = reader.read()
                    assert message is not None
                    got.append(message)
            finally:
                reader.close()
            segments = [m for m in got if isinstance(m, p.Segment)]
            errors = [m for m in got if isinstance(m, p.Error)]
            assert len(segments) + len(errors) == asks
            assert segments, got[:3]
            assert errors
            assert all("segments" in e.message for e in errors), errors[:3]
            reply = _status_in_another_process(service.socket)
            assert reply["bytes_staged"] == len(segments) * os.sysconf("SC_PAGE_SIZE"), reply
            refused = reply["refused"]
            assert isinstance(refused, dict)
            assert refused.get("segments") == len(errors), reply
            shown = run_python(
                "-m", "checkpointd", "status", "--socket", service.socket, check=True
            )
            assert f"refused: {len(errors)} segments" in shown.stdout, shown.stdout
            _save_in_another_process(service.socket, str(tmp_path / "root"))
        finally:
            sock.close()
        time.sleep(0.3)
        assert service.proc.poll() is None, service.log_text()[-3000:]
        assert status(service.socket).bytes_staged == 0


_ACCEPTING = """
import collections, os, resource, sys
import anyio
from checkpointd.daemon.server.admission import accept_loop

async def main() -> None:
    listener = await anyio.create_unix_listener(sys.argv[1])
    held = []
    refused = collections.Counter()

    async def serve(stream) -> None:
        held.append(stream)

    in_use = len(os.listdir("/proc/self/fd"))
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 6, hard))
    async with anyio.create_task_group() as group:
        group.start_soon(accept_loop, listener, serve, group, refused)
        print("ready", flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)
        print(len(held), refused["descriptors"], flush=True)
        group.cancel_scope.cancel()

anyio.run(main)
"""


def test_accepting_out_of_descriptors_refuses_and_goes_on(tmp_path: Path) -> None:
    folder = socket_folder()
    path = os.path.join(folder, "sock")
    proc = subprocess.Popen(
        [sys.executable, "-c", _ACCEPTING, path],
        env=child_env(),
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    socks: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        assert proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready", proc.stderr
        told = 0
        for _ in range(20):
            sock = _connect(path)
            socks.append(sock)
            sock.settimeout(0.5)
            with contextlib.suppress(TimeoutError):  # held: nothing to read
                replies = _replies(sock, 0.5)
                assert len(replies) == 1, replies
                assert isinstance(replies[0], p.Error), replies
                assert "out of file descriptors" in replies[0].message
                told += 1
        assert proc.poll() is None, proc.communicate()[1]
        proc.stdin.write("report\n")
        proc.stdin.flush()
        held, refused = map(int, proc.stdout.readline().split())
        assert proc.wait(30) == 0
        assert 1 <= held < 20
        assert told == 20 - held
        assert refused >= told
    finally:
        for sock in socks:
            sock.close()
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
        shutil.rmtree(folder, ignore_errors=True)
