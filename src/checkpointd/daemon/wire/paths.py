"""Where the service listens, who may talk to it, and one service per socket (a lock).

The socket lives in a folder of mode 0700 owned by the user; a folder owned by
someone else or with a looser mode is refused (another user could replace the
socket). Each connection's peer is checked with SO_PEERCRED: only processes of
the service's own user are served. No torch here.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
import stat
import struct
import tempfile

from checkpointd.errors import InvalidArgumentError, ServiceError

__all__ = [
    "check_folder",
    "default_socket",
    "lock_or_fail",
    "parse_size",
    "peer_credentials",
    "peer_uid",
    "prepare_folder",
    "remove_stale",
]

_SIZE = re.compile(r"\s*([0-9]+)\s*([KMGT]?)(i?B)?\s*\Z", re.IGNORECASE)
_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}


def default_socket() -> str:
    """``$CHECKPOINTD_SOCKET``, else ``$XDG_RUNTIME_DIR/checkpointd/sock``, else
    ``<tempdir>/checkpointd-<uid>/sock``."""
    explicit = os.environ.get("CHECKPOINTD_SOCKET")
    if explicit:
        return explicit
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "checkpointd", "sock")
    return os.path.join(tempfile.gettempdir(), f"checkpointd-{os.getuid()}", "sock")


def check_folder(folder: str) -> None:
    """ServiceError unless ``folder`` is a real folder (not a link) owned by this user
    with mode 0700 (no access for group or others)."""
    try:
        info = os.lstat(folder)
    except FileNotFoundError:
        raise ServiceError(f"the service's socket folder {folder} does not exist") from None
    if not stat.S_ISDIR(info.st_mode):
        raise ServiceError(f"the service's socket folder {folder} is not a folder")
    if info.st_uid != os.getuid():
        raise ServiceError(
            f"the service's socket folder {folder} is owned by uid {info.st_uid}, not by you "
            f"(uid {os.getuid()}): refusing it"
        )
    if info.st_mode & 0o077:
        raise ServiceError(
            f"the service's socket folder {folder} has mode {stat.S_IMODE(info.st_mode):04o}; "
            "it must be 0700 (chmod 700 it, or pick another --socket)"
        )


def prepare_folder(socket_path: str) -> str:
    """Create the socket's folder (mode 0700) if it is missing, check it; return it."""
    folder = os.path.dirname(os.path.abspath(socket_path))
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    check_folder(folder)
    return folder


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket (SO_PEERCRED)."""
    return peer_credentials(sock)[1]


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of a connected Unix socket, as
    they were when it connected (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return int(pid), int(uid)


def parse_size(text: str) -> int:
    """Bytes from ``123``, ``512M``, ``4G``, ``1TiB`` (powers of 1024)."""
    match = _SIZE.match(text)
    if match is None:
        raise InvalidArgumentError(
            f"a size is a number of bytes with an optional K, M, G or T suffix, not {text!r}"
        )
    return int(match.group(1)) * int(1024 ** _POWERS[match.group(2).upper()])


def lock_or_fail(socket_path: str) -> int:
    """Hold ``<socket>.lock`` for the service's life: one service per socket."""
    fd = os.open(f"{socket_path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ServiceError(f"a checkpoint service already runs at {socket_path}") from None
    return fd


def remove_stale(socket_path: str) -> None:
    """Remove a socket left by a dead service (we hold the lock: none is alive)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)
