"""A loopback HTTP front for an S3 server that checks body checksums as S3 does.

Neither moto nor s3rver verifies ``x-amz-checksum-crc32c`` (nor a signed payload's
SHA-256): they store what arrives. This front reads each whole request, lets
``tamper(request_line, body)`` change the body as a faulty network would, then
refuses a body whose ``x-amz-checksum-crc32c`` does not match it with S3's answer
(400 ``BadDigest``); everything else goes on to the server and its reply comes back.
``requests`` records every request as it arrived (before tampering); ``refused``
counts the refusals. Threads only; ``stop()`` ends them.
"""

from __future__ import annotations

import base64
import http.client
import http.server
import threading
from collections.abc import Callable
from dataclasses import dataclass

import crc32c

_BAD_DIGEST = (
    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>BadDigest</Code>"
    b"<Message>The CRC32C you specified did not match the calculated checksum.</Message>"
    b"</Error>"
)
_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "expect", "content-length"})


@dataclass(frozen=True)
class Seen:
    """One request as it arrived: its request line, headers (lower-case names), body."""

    line: str
    headers: dict[str, str]
    body: bytes


def crc32c_header(body: bytes) -> str:
    """The ``x-amz-checksum-crc32c`` value of ``body`` (base64 of the big-endian CRC)."""
    return base64.b64encode(crc32c.crc32c(body).to_bytes(4, "big")).decode("ascii")


class ChecksumFront:
    """Listens on 127.0.0.1:<port> and forwards to ``upstream`` (host, port)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.tamper: Callable[[str, bytes], bytes] = lambda _line, body: body
        self.requests: list[Seen] = []
        self.refused = 0
        self._lock = threading.Lock()
        front = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, and 100-continue answered

            def log_message(self, *_: object) -> None:
                pass

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {k.lower(): v for k, v in self.headers.items()}
                line = self.requestline
                with front._lock:
                    front.requests.append(Seen(line, headers, body))
                body = front.tamper(line, body)
                claimed = headers.get("x-amz-checksum-crc32c")
                if claimed is not None and claimed != crc32c_header(body):
                    with front._lock:
                        front.refused += 1
                    self._reply(400, [("Content-Type", "application/xml")], _BAD_DIGEST)
                    return
                upstream_headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                connection = http.client.HTTPConnection(*upstream, timeout=60)
                try:
                    connection.request(self.command, self.path, body or None, upstream_headers)
                    response = connection.getresponse()
                    reply = response.read()
                    kept = [(k, v) for k, v in response.getheaders() if k.lower() not in _HOP]
                finally:
                    connection.close()
                length_of = response.getheader("Content-Length") if self.command == "HEAD" else None
                self._reply(response.status, kept, reply, length_of)

            def _reply(
                self,
                status: int,
                headers: list[tuple[str, str]],
                body: bytes,
                length: str | None = None,
            ) -> None:
                self.send_response(status)
                for name, value in headers:
                    self.send_header(name, value)
                if status not in (204, 304):
                    self.send_header("Content-Length", length or str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def parts(self) -> list[Seen]:
        """The upload-part requests seen, in arrival order."""
        with self._lock:
            return [
                r for r in self.requests if r.line.startswith("PUT ") and "partNumber=" in r.line
            ]

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(2)
