"""A second S3 implementation for tests: s3rver (node), on loopback, a free port.

s3rver ignores ``If-None-Match`` on PUT and lacks ListMultipartUploads,
AbortMultipartUpload and ListParts, like several S3-compatible servers in the
field. It is installed into ``<repo>/.cache/s3rver`` with
``npm install --prefix .cache/s3rver s3rver@3.7.1``; where that is missing the
tests that need it skip, unless ``CI`` is set, in which case they fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.s3 import S3Endpoint

REPO = Path(__file__).resolve().parents[2]
INSTALL_DIR = REPO / ".cache" / "s3rver"
SCRIPT = INSTALL_DIR / "node_modules" / "s3rver" / "bin" / "s3rver.js"
INSTALL_HINT = "npm install --prefix .cache/s3rver s3rver@3.7.1"
CREDENTIALS = {"key": "S3RVER", "secret": "S3RVER"}
REGION = "us-east-1"
START_TIMEOUT_S = 30.0


class S3rverMissing(Exception):
    """s3rver (or node) is not installed where the tests look for it."""


@dataclass
class S3rver(S3Endpoint):
    process: subprocess.Popen[str]
    reader: threading.Thread
    endpoint: str
    directory: str
    credentials: dict[str, str] = field(default_factory=lambda: dict(CREDENTIALS))

    def stop(self) -> None:
        _stop(self.process, self.reader)
        shutil.rmtree(self.directory, ignore_errors=True)


def _stop(process: subprocess.Popen[str], reader: threading.Thread) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    reader.join(timeout=10)
    if process.stdout is not None:
        process.stdout.close()


def start_s3rver() -> S3rver:
    """Start s3rver on 127.0.0.1 with an OS-chosen port; S3rverMissing if it is not installed."""
    node = shutil.which("node")
    if node is None or not SCRIPT.is_file():
        raise S3rverMissing(f"s3rver is not installed in {INSTALL_DIR} (run: {INSTALL_HINT})")
    directory = tempfile.mkdtemp(prefix="s3rver-")
    command = [node, str(SCRIPT), "-d", directory, "-a", "127.0.0.1", "-p", "0", "-s"]
    command += ["--no-vhost-buckets"]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "NODE_NO_WARNINGS": "1"},
    )
    port: list[int] = []
    seen: list[str] = []
    listening = threading.Event()

    def read_output() -> None:
        # Reads to EOF, so a chatty server never blocks on a full pipe.
        assert process.stdout is not None
        for line in process.stdout:
            if not listening.is_set():
                seen.append(line)
                if line.startswith("S3rver listening on"):
                    port.append(int(line.rsplit(":", 1)[1]))
                    listening.set()
        listening.set()

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    listening.wait(START_TIMEOUT_S)
    if not port:
        _stop(process, reader)
        shutil.rmtree(directory, ignore_errors=True)
        raise RuntimeError(f"s3rver did not start: {''.join(seen)[-2000:]}")
    return S3rver(process, reader, f"http://127.0.0.1:{port[0]}", directory)
