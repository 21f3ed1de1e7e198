"""A connection to the service, and finding or starting the node's service.

``Connection`` is blocking and thread-safe: any thread may make a request
(a frame out, the reply with the same ``id`` back), or ``post`` one without
waiting; a reader thread routes replies to their callers, and the replies to
posted requests and the unasked events (``Committed``, ``Failed``, ``Notice``) to
``on_event``. When the service goes away (killed, or the
connection cut), every waiting request and ``on_lost`` get a ServiceError at
once: the kernel closes a dead process's sockets, so the loss is seen within
the time it takes to read an end of stream. No torch here.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from checkpointd import errors, tunables
from checkpointd.daemon.wire import protocol as p
from checkpointd.daemon.wire.frames import FrameReader, send_frame
from checkpointd.daemon.wire.paths import check_folder, default_socket, peer_uid, prepare_folder
from checkpointd.errors import CheckpointError, ServiceError

__all__ = ["Connection", "connect", "error_from", "socket_path", "status"]

M = TypeVar("M", bound=p.Message)

_FD_CARRIERS = (p.Segment, p.Held)


def error_from(name: str, message: str) -> CheckpointError:
    """The checkpointd error the service reported by class name (ServiceError if the
    name is not one of checkpointd's errors or ProtocolError: nothing else is looked up)."""
    if name == "ProtocolError":  # the service refused a request and ended the connection
        return p.ProtocolError(message)
    cls = getattr(errors, name, None) if name in errors.__all__ else None
    if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
        cls = ServiceError
    return cls(message)


def socket_path(service: str) -> str:
    """The socket ``service`` names: "auto" is the default socket."""
    return default_socket() if service == "auto" else service


class Connection:
    """One client connection to the service. Close it with ``close()``."""

    def __init__(self, path: str, *, timeout: float | None = None) -> None:
        self.path = path
        check_folder(os.path.dirname(os.path.abspath(path)))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(tunables.CONNECT_SECONDS if timeout is None else timeout)
            sock.connect(path)
            sock.settimeout(None)
            if peer_uid(sock) != os.getuid():
                raise ServiceError(f"the service at {path} runs as another user: refusing it")
        except OSError as exc:
            sock.close()
            raise ServiceError(f"no checkpoint service answers at {path} ({exc})") from None
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._reader = FrameReader(sock)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._waiting: dict[int, Future[tuple[p.Message, int | None]]] = {}
        self._posted: set[int] = set()  # requests whose reply goes to on_event
        self._ids = itertools.count(1)
        self.lost: ServiceError | None = None
        self.on_event: Callable[[p.Message], None] = lambda message: None
        self.on_lost: Callable[[ServiceError], None] = lambda error: None
        self._thread = threading.Thread(
            target=self._read_loop, name="checkpointd-service-client", daemon=True
        )
        self._thread.start()

    def request(self, kind: type[M], **fields: Any) -> tuple[p.Message, int | None]:
        """Send ``kind(id=..., **fields)`` and wait for its reply (and the fd beside it).

        Raises the error the service replied with, or ServiceError if it went away."""
        return self.start(kind, **fields).result()

    def start(self, kind: type[M], **fields: Any) -> Future[tuple[p.Message, int | None]]:
        """Send ``kind(id=..., **fields)``; the future of its reply (and the fd beside it:
        whoever takes the result closes it), which fails with the error the service
        replied with, or ServiceError if it went away. Any thread."""
        future: Future[tuple[p.Message, int | None]] = Future()
        with self._lock:
            if self.lost is not None:
                raise self.lost
            ident = next(self._ids)
            self._waiting[ident] = future
        try:
            with self._send_lock:
                send_frame(self._sock, kind(id=ident, **fields))  # type: ignore[call-arg]
        except OSError as exc:
            self._fail(ServiceError(f"the checkpoint service at {self.path} went away ({exc})"))
        except BaseException:
            with self._lock:
                self._waiting.pop(ident, None)
            raise
        return future

    def new_id(self) -> int:
        """An id for a request to ``post``."""
        with self._lock:
            return next(self._ids)

    def post(self, ident: int, frame: bytes) -> None:
        """Send ``frame`` (``protocol.encode`` of a request whose id is ``ident``, from
        ``new_id``) without waiting for the reply: the reply, an ``Error`` included,
        goes to ``on_event``. Returns once the frame is in the service's socket queue
        (the service reads it even if this process dies now). ServiceError if the
        service went away. Any thread."""
        with self._lock:
            if self.lost is not None:
                raise self.lost
            self._posted.add(ident)
        try:
            with self._send_lock:
                self._sock.sendall(frame)
        except OSError as exc:
            error = ServiceError(f"the checkpoint service at {self.path} went away ({exc})")
            self._fail(error)
            raise (self.lost or error) from None
        except BaseException:
            with self._lock:
                self._posted.discard(ident)
            raise

    def _read_loop(self) -> None:
        why = "closed the connection"
        try:
            while True:
                message = self._reader.read()
                if message is None:
                    break
                fd = self._reader.take_fd() if isinstance(message, _FD_CARRIERS) else None
                ident = getattr(message, "id", None)
                if isinstance(message, p.Committed | p.Failed | p.Notice):
                    self.on_event(message)
                    continue
                with self._lock:
                    future = self._waiting.pop(ident, None) if ident else None
                    posted = future is None and ident in self._posted
                    self._posted.discard(ident)
                if posted:
                    if fd is not None:
                        os.close(fd)
                    self.on_event(message)
                    continue
                if isinstance(message, p.Error):
                    error = error_from(message.error, message.message)
                    if future is None:
                        why = f"reported {message.error}: {message.message}"
                        break
                    future.set_exception(error)
                elif future is not None:
                    future.set_result((message, fd))
                elif fd is not None:
                    os.close(fd)
        except ConnectionResetError:  # it died with frames of ours unread
            why = "went away (connection reset)"
        except (OSError, p.ProtocolError) as exc:
            why = f"broke the connection ({exc})"
        except BaseException as exc:  # a bug: still fail every waiter
            why = f"broke the connection ({type(exc).__name__}: {exc})"
        self._fail(ServiceError(f"the checkpoint service at {self.path} {why}"))

    def _fail(self, error: ServiceError) -> None:
        with self._lock:
            if self.lost is None:
                self.lost = error
            waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(error)
        self.on_lost(self.lost)

    def close(self) -> None:
        """Close the connection (saves already accepted still commit)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        if threading.current_thread() is not self._thread:
            self._thread.join(tunables.CLIENT_CLOSE_SECONDS)
        self._sock.close()
        self._reader.close()


def connect(service: str, *, start: bool = True) -> Connection:
    """A connection to the service ``service`` names: a socket path, or "auto" (the
    default socket; with ``start``, a service is started there if none answers)."""
    path = socket_path(service)
    try:
        return Connection(path)
    except ServiceError:
        if service != "auto" or not start:
            raise
    return _start_and_connect(path)


def _start_and_connect(path: str) -> Connection:
    """Start a detached service at ``path`` unless another process does first (a lock
    in the socket's folder makes one starter wait for the other); connect to it."""
    folder = prepare_folder(path)
    lock = os.open(f"{path}.start", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with contextlib.suppress(ServiceError):
            return Connection(path)  # another process started it meanwhile
        log_path = os.path.join(folder, "service.log")
        idle = os.environ.get("CHECKPOINTD_IDLE_EXIT", str(tunables.SERVICE_AUTO_IDLE_SECONDS))
        command = [sys.executable, "-m", "checkpointd", "serve", "--socket", path]
        command += ["--idle-exit", idle]
        with open(log_path, "ab") as log:
            # sh starts the service in the background and exits at once: the service is
            # nobody's child here (no zombie, no handle to reap), in a session of its own
            # (not killed with the trainer's process group), stdin /dev/null, output to log.
            starter = subprocess.Popen(
                ["/bin/sh", "-c", 'exec "$@" &', "checkpointd-start", *command],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                close_fds=True,
            )
            starter.wait()
        wait = tunables.SERVICE_START_SECONDS
        deadline = time.monotonic() + wait
        while True:
            with contextlib.suppress(ServiceError):
                return Connection(path)
            if time.monotonic() > deadline:
                raise ServiceError(
                    f"the checkpoint service started at {path} did not answer within "
                    f"{wait:g}s; see {log_path}"
                )
            time.sleep(tunables.SERVICE_START_POLL_SECONDS)
    finally:
        os.close(lock)


def status(service: str) -> p.StatusReply:
    """The service's status (never starts one); ServiceError if none answers."""
    conn = connect(service, start=False)
    try:
        reply, _ = conn.request(p.Status)
    finally:
        conn.close()
    assert isinstance(reply, p.StatusReply)
    return reply
