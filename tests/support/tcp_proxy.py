"""A loopback TCP proxy that injects network faults between s3fs and moto's server.

Each accepted connection is forwarded to the upstream port. A ``fault`` hook,
called with the connection's number and the bytes the client has sent so far,
decides per chunk: ``"pass"``, ``"drop"`` (close both sides mid-request),
``"delay"`` (sleep ``delay_s`` then pass), ``"500"`` (answer an HTTP 500
without forwarding), or ``"cut_reply"`` (forward the request, then close the
connection before the reply: the client cannot know whether it happened).
``seen`` holds the current request (a chunk starting with a method starts one). Threads only; stop() ends them all.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from typing import Literal

Action = Literal["pass", "drop", "delay", "500", "cut_reply"]
_METHODS = (b"GET ", b"PUT ", b"POST ", b"HEAD ", b"DELETE ")

_ERROR_500 = (
    b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/xml\r\n"
    b"Content-Length: 118\r\nConnection: close\r\n\r\n"
    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InternalError</Code>"
    b"<Message>injected</Message></Error>\n"
)


def _hang_up(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class FaultProxy:
    """Forward 127.0.0.1:<port> to ``upstream``, applying ``fault`` to client data."""

    def __init__(self, upstream: tuple[str, int], delay_s: float = 0.5) -> None:
        self.upstream = upstream
        self.delay_s = delay_s
        self.fault: Callable[[int, bytes], Action] = lambda _n, _seen: "pass"
        self.counts: dict[str, int] = {
            "connections": 0,
            "drop": 0,
            "delay": 0,
            "500": 0,
            "cut_reply": 0,
        }
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._server.getsockname()[1]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        self._server.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.counts["connections"] += 1
                number = self.counts["connections"]
            self._spawn(self._serve, client, number)

    def _serve(self, client: socket.socket, number: int) -> None:
        try:
            upstream = socket.create_connection(self.upstream)
        except OSError:
            client.close()
            return
        mute = threading.Event()
        self._spawn(self._pipe, upstream, client, mute)
        seen = b""
        try:
            while not self._stop.is_set():
                data = client.recv(65536)
                if not data:
                    break
                seen = data if data.startswith(_METHODS) else seen + data
                action = self.fault(number, seen)
                if action != "pass":
                    with self._lock:
                        self.counts[action] += 1
                if action == "drop":
                    break
                if action == "500":
                    client.sendall(_ERROR_500)
                    break
                if action == "cut_reply" and not mute.is_set():
                    # Forward the whole request (its body may follow), drop the reply, then hang up.
                    mute.set()
                    threading.Timer(self.delay_s, _hang_up, (client,)).start()
                if action == "delay":
                    time.sleep(self.delay_s)
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (client, upstream):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket, mute: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if not mute.is_set():
                    sink.sendall(data)
                elif data.startswith(b"HTTP/1.1 100"):
                    # Let "100 Continue" through so the client sends the body; drop the reply.
                    sink.sendall(data[: data.index(b"\r\n\r\n") + 4])
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def stop(self) -> None:
        self._stop.set()
        self._server.close()
        for thread in self._threads:
            thread.join(2)
