"""One process per test session that has imported torch and checkpointd once, and forks a
rank of a job on request, so that a rank starts in milliseconds instead of paying the
imports (about 1.5 s of CPU each) again.

Each rank is still its own process, as ``python -m module *args`` would make it: its own
environment, working folder, argv, stdout on /dev/null and stderr in its log file, run
as ``__main__`` through runpy, ending through the interpreter's normal exit (threads
joined, atexit handlers run). Only what the imports themselves did is shared, and the
zygote refuses to serve if the imports started a Python thread (a fork would lose it).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
_PRELOAD = ("torch", "torch.distributed", "checkpointd", "checkpointd.api.writer")


class ZygoteError(RuntimeError):
    """The zygote could not be started or stopped answering."""


class Zygote:
    """The test's side: ask for ranks, wait for their exits (from the test's thread)."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from tests.support.zygote import serve; serve()"],
            env=env,
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
        )
        self._buffer = b""
        self._exits: dict[int, int] = {}
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
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError("no answer from the zygote")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise ZygoteError(f"the zygote exited ({self._proc.wait()})")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        found: dict[str, Any] = json.loads(line)
        if "exited" in found:
            self._exits[int(found["exited"])] = int(found["code"])
        return found

    def start(self, module: str, args: Sequence[str], env: Mapping[str, str], stderr: Path) -> int:
        """Fork ``python -m module *args`` with ``env``, cwd the checkout; its pid."""
        assert self._proc.stdin is not None
        request = {
            "module": module,
            "args": list(args),
            "env": dict(env),
            "cwd": str(REPO),
            "stderr": str(stderr),
        }
        self._proc.stdin.write(json.dumps(request).encode() + b"\n")
        self._proc.stdin.flush()
        while True:
            found = self._line(timeout=60)
            if "pid" in found:
                return int(found["pid"])

    def wait(self, pid: int, timeout: float) -> int | None:
        """The exit code of ``pid`` (minus a signal number), or None after ``timeout``."""
        deadline = time.monotonic() + timeout
        while pid not in self._exits:
            try:
                self._line(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return None
        return self._exits.pop(pid)

    def kill(self, pid: int) -> None:
        """SIGKILL ``pid`` and wait until the zygote has reaped it."""
        if pid in self._exits:
            del self._exits[pid]
            return
        with contextlib.suppress(ProcessLookupError):  # a zombie not yet reaped
            os.kill(pid, signal.SIGKILL)
        if self.wait(pid, 60) is None:
            raise ZygoteError(f"rank {pid} outlived SIGKILL")

    def alive(self) -> bool:
        return self._proc.poll() is None

    def stop(self) -> None:
        """End the zygote (ranks still running finish on their own)."""
        if self._proc.stdin is not None:
            self._proc.stdin.close()
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


# The zygote's side.


def _say(found: dict[str, Any]) -> None:
    os.write(1, json.dumps(found).encode() + b"\n")  # unbuffered: nothing left for a fork


def _become(request: dict[str, Any], wake: tuple[int, int]) -> None:
    """In the forked child: turn into ``python -m module *args`` and run it."""
    import runpy

    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in wake:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDWR)
    log = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd, target in ((0, null), (1, null), (2, log)):
        os.dup2(target, fd)
    os.close(null)
    os.close(log)
    sys.argv = [request["module"], *request["args"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)  # the interpreter's own exit: threads joined, atexit handlers run


def serve() -> None:
    """The zygote's loop: a JSON request per stdin line, a fork per request; report each
    child's pid and, once reaped, its exit code."""
    import importlib

    for name in _PRELOAD:
        importlib.import_module(name)
    # torch's import starts one native thread of its own and re-makes its pools after a
    # fork (as DataLoader's forked workers rely on); a Python thread would be lost.
    if threading.active_count() != 1:
        sys.exit("the imports started a Python thread: a fork would lose it")
    wake = os.pipe()
    os.set_blocking(wake[0], False)
    os.set_blocking(wake[1], False)
    signal.set_wakeup_fd(wake[1])
    signal.signal(signal.SIGCHLD, lambda *_: None)
    _say({"ready": True})
    pending = b""
    while True:
        readable = select.select([0, wake[0]], [], [])[0]
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
                _say({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
        if 0 in readable:
            chunk = os.read(0, 65536)
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _become(request, wake)
                _say({"pid": pid})
