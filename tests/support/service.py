"""A real ``checkpointd serve`` process for tests, and trainer subprocesses that use it."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from checkpointd.daemon.client.client import Connection, status
from checkpointd.daemon.wire.protocol import HeldFile
from checkpointd.errors import ServiceError
from tests.support import zygote

REPO = Path(__file__).resolve().parents[2]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process: this checkout's code first."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
        **extra,
    }


def run_python(*args: str, check: bool) -> subprocess.CompletedProcess[str]:
    """``python *args`` in this checkout (a CLI command, a ``-c`` snippet), output captured
    as text, at most 60 s."""
    return subprocess.run(
        [sys.executable, *args],
        env=child_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=check,
    )


def wait_answers(
    socket: str, timeout: float = 60.0, proc: subprocess.Popen[bytes] | None = None
) -> None:
    """Block until a service answers at ``socket``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            Connection(socket).close()
            return
        except ServiceError:
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"the service exited with {proc.returncode}") from None
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@dataclass
class Service:
    """A running ``checkpointd serve``: its process, socket and log."""

    proc: subprocess.Popen[bytes]
    socket: str
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def socket_folder() -> str:
    """A fresh 0700 folder with a short path (a socket path has at most 107 bytes)."""
    return tempfile.mkdtemp(prefix="ckd-", dir="/tmp")


def start_service(
    folder: str,
    *args: str,
    gate: str | None = None,
    hold: str = "make_dir",
    cwd: Path = REPO,
    as_deployed: bool = False,
) -> Service:
    """``checkpointd serve --socket FOLDER/sock *args`` run in ``cwd``, once it answers.
    With ``gate``, every save's writes wait until that file exists
    (service_jobs.held_serve). Unless ``as_deployed`` or ``args`` set one, the service
    runs at the test's own niceness rather than serve's default +10: with the suite's
    workers busy, a +10 service gets a tenth of a core and its tests crawl toward their
    timeout (the priority tests ask for the defaults)."""
    if not as_deployed and "--niceness" not in args:
        args = (*args, "--niceness", "0")
    socket = os.path.join(folder, "sock")
    log = Path(folder) / "serve.log"
    command = ["-m", "checkpointd", "serve"]
    if gate is not None:
        command = ["-m", "tests.support.service_jobs", "held-serve", gate, hold, "--"]
    with log.open("ab") as out:
        proc = zygote.popen(
            [sys.executable, *command, "--socket", socket, *args],
            env=child_env(),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
        )
    try:
        wait_answers(socket, proc=proc)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return Service(proc, socket, log)


@contextmanager
def running_service(
    *args: str,
    gate: str | None = None,
    hold: str = "make_dir",
    cwd: Path = REPO,
    as_deployed: bool = False,
) -> Iterator[Service]:
    """A service in a fresh socket folder for the block (``start_service``'s arguments);
    stopped (and the folder removed) after."""
    folder = socket_folder()
    try:
        running = start_service(
            folder, *args, gate=gate, hold=hold, cwd=cwd, as_deployed=as_deployed
        )
        try:
            yield running
        finally:
            running.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def auto_socket_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``CHECKPOINTD_SOCKET`` in a fresh folder, for ``service="auto"``; whatever service
    ends up there is stopped after the block, its log printed (shown when a test fails)."""
    folder = socket_folder()
    socket = os.path.join(folder, "sock")
    monkeypatch.setenv("CHECKPOINTD_SOCKET", socket)
    monkeypatch.setenv("CHECKPOINTD_IDLE_EXIT", "60")
    monkeypatch.setenv("PYTHONPATH", str(REPO / "src"))
    try:
        yield socket
    finally:
        with contextlib.suppress(Exception):
            os.kill(status(socket).pid, signal.SIGTERM)
        time.sleep(0.2)
        log = Path(folder, "service.log")
        if log.exists():
            print(log.read_text())
        shutil.rmtree(folder, ignore_errors=True)


def trainer(
    socket: str, root: str, steps: int, *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """A trainer subprocess (service_jobs.trainer), its stdout a pipe of lines."""
    return zygote.popen(
        [
            sys.executable,
            "-m",
            "tests.support.service_jobs",
            "trainer",
            socket,
            root,
            str(steps),
            *extra,
        ],
        env=child_env(**(env or {})),
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def reap(proc: subprocess.Popen[str]) -> str:
    """Kill ``proc`` if it still runs, wait for it, close its pipes; its stderr."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    err = proc.stderr.read() if proc.stderr is not None and not proc.stderr.closed else ""
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
    return err


def files_by_component(root: Path, step: int) -> dict[str, bytes]:
    """Each file of a committed step by component and kind (names carry a random token)."""
    import msgspec

    folder = root / f"{step:012d}"
    manifest = msgspec.json.decode((folder / "manifest.json").read_bytes())
    found: dict[str, bytes] = {}
    for name, entry in manifest["components"].items():
        found[f"{name}.tree"] = (folder / entry["tree"]).read_bytes()
        for i, tensors in enumerate(entry["tensors"]):
            found[f"{name}.tensors{i}"] = (folder / tensors).read_bytes()
    return found


def args_list(values: Sequence[object]) -> list[str]:
    return [str(v) for v in values]


def kill_at_line(proc: subprocess.Popen[str], wanted: str, delay: float = 0.0) -> str:
    """Read ``proc``'s stdout until the line ``wanted``, SIGKILL it (after ``delay``
    seconds), reap it; its stderr. AssertionError if it ended before that line."""
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip() == wanted:
                time.sleep(delay)
                proc.send_signal(signal.SIGKILL)
                break
        else:
            raise AssertionError(f"the process ended before printing {wanted!r}")
    finally:
        err = reap(proc)
    assert proc.returncode == -signal.SIGKILL, err
    return err


def wait_for(condition: Callable[[], bool], seconds: float = 30.0) -> None:
    """Poll ``condition`` until it holds; AssertionError after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the condition"
        time.sleep(0.05)


@contextmanager
def services_per_rank(
    world: int, gate: str | None = None, args: Sequence[str] = ()
) -> Iterator[list[Service]]:
    """One real service per rank (a "node" each), each in a socket folder of its own,
    run with ``args``; ``gate``: their writes held until that file exists
    (``start_service``)."""
    folders = [socket_folder() for _ in range(world)]
    running: list[Service] = []
    try:
        for folder in folders:
            running.append(start_service(folder, *args, gate=gate))
        yield running
    finally:
        for service in running:
            service.stop()
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)


def rank_processes(
    module: str,
    services: list[Service],
    out: Path,
    port: int,
    *,
    before: Sequence[str] = (),
    after: Sequence[str] = (),
) -> list[subprocess.Popen[str]]:
    """One rank of a job per service: ``python -m module *before SOCKET *after RANK WORLD
    PORT`` (``port``: the job's hosted store), stdout a pipe of lines, stderr in
    ``out/stderrR.txt``."""
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank, service in enumerate(services):
        args = [*before, service.socket, *after, str(rank), str(len(services)), str(port)]
        with (out / f"stderr{rank}.txt").open("wb") as log:  # the child keeps its copy
            procs.append(
                zygote.popen(
                    [sys.executable, "-m", module, *args],
                    env=child_env(),
                    cwd=REPO,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                )
            )
    return procs


def kill_ranks_at_line(procs: list[subprocess.Popen[str]], wanted: str, out: Path) -> None:
    """Once every rank printed the line ``wanted``, SIGKILL them all and reap them
    (AssertionError, with the rank's stderr from ``out``, if one ended before it)."""
    for rank, proc in enumerate(procs):
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip() == wanted:
                break
        else:
            raise AssertionError((out / f"stderr{rank}.txt").read_text()[-3000:])
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
    for proc in procs:
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * len(procs)


def wait_ranks(procs: list[subprocess.Popen[str]], out: Path, timeout: float = 180) -> None:
    """Wait for every rank to exit 0 (AssertionError with that rank's stderr from
    ``out`` otherwise), closing their stdout pipes."""
    for rank, proc in enumerate(procs):
        assert proc.wait(timeout) == 0, (out / f"stderr{rank}.txt").read_text()
        assert proc.stdout is not None
        proc.stdout.close()


def held_files(socket: str, root: str, step: int) -> list[HeldFile]:
    """The files ``socket``'s service holds of ``step`` of ``root``, asked as a
    restoring client would (the lent segment's fd closed at once)."""
    from checkpointd.daemon.client.client import connect
    from checkpointd.daemon.wire import protocol as p

    borrower = connect(socket, start=False)
    try:
        reply, fd = borrower.request(p.Lookup, root=root, storage_options=None, step=step)
        assert isinstance(reply, p.Held), reply
        assert fd is not None
        os.close(fd)
    finally:
        borrower.close()
    return reply.files


def damage_held_copy(service_pid: int, socket: str, root: str, step: int) -> str:
    """Flip one byte in the middle of the largest held file of ``step``, writing into
    the service's segment through its memfd in /proc (as a stray write would); returns
    that file's path (relative to the step folder)."""
    file = max(held_files(socket, root, step), key=lambda f: f.length)
    at = file.offset + file.length // 2
    flipped: set[int] = set()  # memfd inodes (the service may hold several fds of one)
    for fd in Path(f"/proc/{service_pid}/fd").iterdir():
        # The service opens and closes fds meanwhile (connections, spare segments):
        # one listed may be gone by the time it is looked at.
        try:
            if not os.readlink(fd).startswith("/memfd:checkpointd-"):
                continue
            memory = open(fd, "r+b")  # noqa: SIM115 - closed below; the open may fail
        except FileNotFoundError:
            continue
        with memory:  # the held segment and any spare: flip each once
            info = os.fstat(memory.fileno())
            if info.st_ino in flipped or info.st_size < at + 1:
                continue
            flipped.add(info.st_ino)
            memory.seek(at)
            byte = memory.read(1)
            memory.seek(at)
            memory.write(bytes([byte[0] ^ 0xFF]))
    assert flipped
    return file.path


def join_peer_job(socket: str, *, root: str, job: str, key: bytes) -> str:
    """Register ``job`` with ``key`` for ``root`` at ``socket``'s service, as a trainer's
    rank 0 would with no other service; its peer address (HOST:PORT)."""
    from checkpointd.daemon.client.client import connect
    from checkpointd.daemon.wire import protocol as p

    reply = status(socket)
    assert reply.peer_address is not None
    conn = connect(socket, start=False)
    try:
        me = p.PeerService(reply.service, reply.peer_address, [0])
        conn.request(
            p.JoinPeers,
            root=root,
            storage_options=None,
            job=job,
            key=key,
            ranks=[0],
            replicas=0,
            services=[me],
        )
    finally:
        conn.close()
    return reply.peer_address
