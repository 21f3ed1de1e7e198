"""One process per test session that has imported torch and checkpointd once, and forks a
rank of a job on request, so that a rank starts in milliseconds instead of paying the
imports (about 1.5 s of CPU each) again.

Each rank is still its own process, as ``python -m module *args`` would make it: its own
environment, working folder, argv, standard streams (the descriptors the caller hands
over, passed through a Unix socket), run as ``__main__`` through runpy, ending through
the interpreter's normal exit (threads joined, atexit handlers run). Only what the imports
themselves did is shared, and the zygote refuses to serve if the imports started a Python
thread (a fork would lose it). ``ForkedPopen`` is a ``subprocess.Popen`` whose child the
zygote forks (service processes, trainers): the caller keeps Popen's pipes, signals,
``wait``, ``poll`` and ``communicate``; the zygote reports each exit status.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
_PRELOAD = (
    "torch",
    "torch.distributed",
    "checkpointd",
    "checkpointd.api.writer",
    # What an FSDP2, DTensor or DCP rank imports on its first sharded call (torch._dynamo
    # through DTensor.from_local alone: ~0.7 s of CPU); once here (~1.3 s of CPU) instead of
    # in every rank: test_sharded.py 103 -> 40 s of CPU, test_service_sharded.py 88 -> 44 s.
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch._dynamo",
)


class ZygoteError(RuntimeError):
    """The zygote could not be started or stopped answering."""


class Zygote:
    """The test's side: ask for ranks, wait for their exits (from the test's thread)."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
        self.env: Mapping[str, str] = env  # what the zygote and its imports started with
        # Requests go over a socket, each one message with the child's three standard
        # descriptors attached; answers (pids, exit statuses) come back as lines on stdout.
        self._requests, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    f"from tests.support.zygote import serve; serve({theirs.fileno()})",
                ],
                env=env,
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=None,
                pass_fds=(theirs.fileno(),),
            )
        self._buffer = b""
        self._exits: dict[int, int] = {}  # pid -> raw wait status, reported and not yet asked
        self._io = threading.RLock()  # one reader of the answers, one request at a time
        try:
            if self._line(timeout=120).get("ready") is not True:
                raise ZygoteError("the zygote did not get ready")
        except BaseException:
            self.stop()
            raise

    def _line(self, timeout: float) -> dict[str, Any]:
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if not select.select([fd], [], [], max(0.0, left))[0]:
                raise TimeoutError("no answer from the zygote")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise ZygoteError(f"the zygote exited ({self._proc.wait()})")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        found: dict[str, Any] = json.loads(line)
        if "exited" in found:
            self._exits[int(found["exited"])] = int(found["status"])
        return found

    def start(self, module: str, args: Sequence[str], env: Mapping[str, str], stderr: Path) -> int:
        """Fork ``python -m module *args`` with ``env``, cwd the checkout, stdin and stdout
        on /dev/null and stderr to the file ``stderr``; its pid."""
        null = os.open(os.devnull, os.O_RDWR)
        try:
            log = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                return self.spawn(module, args, env, REPO, (null, null, log))
            finally:
                os.close(log)
        finally:
            os.close(null)

    def spawn(
        self,
        module: str,
        args: Sequence[str],
        env: Mapping[str, str],
        cwd: str | os.PathLike[str],
        fds: tuple[int, int, int],
    ) -> int:
        """Fork ``python -m module *args`` with ``env`` in ``cwd``, its stdin, stdout and
        stderr copies of ``fds`` (the caller keeps its own); its pid."""
        request = {"module": module, "args": list(args), "env": dict(env), "cwd": str(cwd)}
        with self._io:
            socket.send_fds(self._requests, [json.dumps(request).encode()], list(fds))
            while True:
                found = self._line(timeout=60)
                if "pid" in found:
                    return int(found["pid"])

    def status(self, pid: int, timeout: float | None) -> int | None:
        """The raw wait status of ``pid`` once it exited (reported once), or None while
        it still runs after ``timeout`` seconds (0: only look; None: wait for it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._io:
                if pid in self._exits:
                    return self._exits.pop(pid)
                left = 0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic()))
                try:
                    self._line(timeout=left)
                    continue  # drain whatever else already came
                except TimeoutError:
                    pass
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def wait(self, pid: int, timeout: float) -> int | None:
        """The exit code of ``pid`` (minus a signal number), or None after ``timeout``."""
        found = self.status(pid, timeout)
        return None if found is None else os.waitstatus_to_exitcode(found)

    def kill(self, pid: int) -> None:
        """SIGKILL ``pid`` and wait until the zygote has reaped it."""
        if self.status(pid, 0) is not None:
            return
        with contextlib.suppress(ProcessLookupError):  # a zombie not yet reaped
            os.kill(pid, signal.SIGKILL)
        if self.wait(pid, 60) is None:
            raise ZygoteError(f"rank {pid} outlived SIGKILL")

    def alive(self) -> bool:
        return self._proc.poll() is None

    def stop(self) -> None:
        """End the zygote (ranks still running finish on their own)."""
        self._requests.close()
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()


_shared: Zygote | None = None


def shared() -> Zygote:
    """The session's zygote, started on first use."""
    global _shared
    if _shared is None or not _shared.alive():
        _shared = Zygote()
    return _shared


def stop_shared() -> None:
    """Stop the session's zygote if one was started (from the session's teardown)."""
    global _shared
    if _shared is not None:
        _shared.stop()
        _shared = None


def enabled() -> bool:
    """Whether tests fork their Python children from the zygote (CHECKPOINTD_TEST_ZYGOTE=0:
    fresh interpreters instead)."""
    return os.environ.get("CHECKPOINTD_TEST_ZYGOTE", "1") != "0"


# Popen's arguments a forked child cannot honour; given any, ``popen`` runs a real Popen.
_EXEC_ONLY = ("preexec_fn", "pass_fds", "start_new_session", "process_group", "shell", "user")


# Variables read when the interpreter starts or torch is imported (threads, logging, hash
# seed, libraries): a child whose value differs from the zygote's must start afresh.
# (Not TORCHINDUCTOR_*: torch sets those in its own environment as it runs; nor CUDA_*:
# read when CUDA starts, which the zygote never does.)
_IMPORT_TIME = ("PYTHON", "OMP_", "MKL_", "KMP_", "TORCH_", "PYTORCH_", "LD_")


def _same_start(env: Mapping[str, str]) -> bool:
    """Whether a child with ``env`` starts as the zygote did (PYTHONPATH aside: the
    zygote's path has the checkout's src and root, which every child's path names)."""
    ours = _shared.env if _shared is not None and _shared.alive() else os.environ
    names = {n for n in (*env, *ours) if n.startswith(_IMPORT_TIME) and n != "PYTHONPATH"}
    return all(env.get(n) == ours.get(n) for n in names)


def popen(command: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(command, **kwargs)``; a ``ForkedPopen`` when ``command`` is
    ``[sys.executable, "-m", module, *args]``, the zygote is ``enabled`` and the child's
    environment agrees with the zygote's where the imports read it."""
    forkable = (
        enabled()
        and len(command) >= 3
        and command[0] == sys.executable
        and command[1] == "-m"
        and not any(kwargs.get(name) for name in _EXEC_ONLY)
        and _same_start(os.environ if kwargs.get("env") is None else kwargs["env"])
    )
    return (ForkedPopen if forkable else subprocess.Popen)(list(command), **kwargs)


def run(
    command: Sequence[str],
    *,
    capture_output: bool = False,
    timeout: float | None = None,
    check: bool = False,
    **kwargs: Any,
) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run(command, ...)`` with its child from ``popen`` (forked by the zygote
    where it can be); killed after ``timeout`` seconds (TimeoutExpired, as run raises)."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with popen(command, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            proc.kill()
            exc.stdout, exc.stderr = proc.communicate()
            raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


class ForkedPopen(subprocess.Popen[Any]):
    """A ``subprocess.Popen`` of ``[sys.executable, "-m", module, *args]`` whose child the
    session's zygote forks instead of starting a fresh interpreter (about 1.5 s of CPU
    for torch's import). Standard streams (pipes, files, DEVNULL), env, cwd, text mode,
    signals, ``poll``, ``wait`` and ``communicate`` work as Popen's; the child's parent
    is the zygote, which reports its exit status."""

    _zygote: Zygote

    def _execute_child(self, *params: Any) -> None:
        # Popen's own order: args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
        # startupinfo, creationflags, shell, then the six pipe ends, then the rest.
        args, cwd, env = params[0], params[5], params[6]
        p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite = params[10:16]
        # -1: not redirected, so the child shares this process's own stream.
        fds = (
            p2cread if p2cread != -1 else 0,
            c2pwrite if c2pwrite != -1 else 1,
            errwrite if errwrite != -1 else 2,
        )
        try:
            self._zygote = shared()
            self.pid = self._zygote.spawn(
                args[2],
                args[3:],
                os.environ if env is None else env,
                os.getcwd() if cwd is None else cwd,
                fds,
            )
            self._child_created = True
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)  # type: ignore[attr-defined]

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:
        found = self._zygote.status(self.pid, 0 if wait_flags & os.WNOHANG else None)
        return (0, 0) if found is None else (self.pid, found)

    def _internal_poll(self, _deadstate: int | None = None, **_unused: Any) -> int | None:
        if self.returncode is None and self._waitpid_lock.acquire(False):  # type: ignore[attr-defined]
            try:
                if self.returncode is None:
                    pid, found = self._try_wait(os.WNOHANG)
                    if pid == self.pid:
                        self._handle_exitstatus(found)  # type: ignore[attr-defined]
            except (OSError, ValueError, ZygoteError, TimeoutError):
                if _deadstate is None:
                    raise
                self.returncode = _deadstate  # the zygote is gone (the session's end)
            finally:
                self._waitpid_lock.release()  # type: ignore[attr-defined]
        return self.returncode


# The zygote's side.


def _say(found: dict[str, Any]) -> None:
    os.write(1, json.dumps(found).encode() + b"\n")  # unbuffered: nothing left for a fork


def _become(request: dict[str, Any], fds: list[int], ours: Sequence[int]) -> None:
    """In the forked child: turn into ``python -m module *args`` with ``fds`` as its
    standard streams, and run it."""
    import runpy

    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in ours:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # Received descriptors are above 2 (the zygote's own 0-2 are open), so no dup2 below
    # overwrites one still to be copied.
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        os.close(fd)
    sys.argv = [request["module"], *request["args"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    # The interpreter's own exit: threads joined, atexit handlers run, modules torn down.
    # (Skipping the teardown with os._exit after those steps saved about 0.6 s of CPU a
    # child, but hung a shard_job rank at exit: test_sharded's refused saves.)
    sys.exit(0)


def serve(requests_fd: int) -> None:
    """The zygote's loop: a JSON request per message on the socket ``requests_fd`` (its
    three descriptors attached), a fork per request; report each child's pid and, once
    reaped, its exit code and raw wait status."""
    import gc
    import importlib

    for name in _PRELOAD:
        importlib.import_module(name)
    # torch's import starts one native thread of its own and re-makes its pools after a
    # fork (as DataLoader's forked workers rely on); a Python thread would be lost.
    if threading.active_count() != 1:
        sys.exit("the imports started a Python thread: a fork would lose it")
    # What the imports made lives as long as every child: out of the collector's sight, a
    # child's collections (and the last one, at its exit: ~0.5 s over torch's objects on
    # 2 cores) skip it, and its pages stay shared with the zygote instead of copied.
    gc.freeze()
    wake = os.pipe()
    os.set_blocking(wake[0], False)
    os.set_blocking(wake[1], False)
    signal.set_wakeup_fd(wake[1])
    signal.signal(signal.SIGCHLD, lambda *_: None)
    requests = socket.socket(fileno=requests_fd)
    _say({"ready": True})
    while True:
        readable = select.select([requests_fd, wake[0]], [], [])[0]
        if wake[0] in readable:
            while True:
                try:
                    if not os.read(wake[0], 512):
                        break
                except BlockingIOError:
                    break
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                code = os.waitstatus_to_exitcode(status)
                _say({"exited": pid, "code": code, "status": status})
        if requests_fd in readable:
            message, fds, flags, _ = socket.recv_fds(requests, 1 << 20, 3)
            if not message:  # the session's end: nothing to flush, skip torch's teardown
                os._exit(0)
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(fds) != 3:
                sys.exit(f"a request came cut short ({len(message)} bytes, {len(fds)} fds)")
            pid = os.fork()
            if pid == 0:
                requests.detach()  # closed in _become; the object must not close it again
                _become(json.loads(message), fds, (*wake, requests_fd))
            for fd in fds:
                os.close(fd)
            _say({"pid": pid})
