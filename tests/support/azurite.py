"""Azure Blob Storage for tests: Azurite's blob service (node), on loopback, a free port.

Azurite is installed into ``<repo>/.cache/azurite`` with
``npm install --prefix .cache/azurite azurite@3.37.0``; where that is missing
the tests that need it skip, unless ``CI`` is set, in which case they fail.
It runs in memory with its well-known development account (devstoreaccount1)
and honours ``If-None-Match: *`` on uploads and block-list commits.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
INSTALL_DIR = REPO / ".cache" / "azurite"
SCRIPT = INSTALL_DIR / "node_modules" / "azurite" / "dist" / "src" / "blob" / "main.js"
INSTALL_HINT = "npm install --prefix .cache/azurite azurite@3.37.0"
ACCOUNT = "devstoreaccount1"
# Azurite's published development key (not a secret: every Azurite install has it).
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
START_TIMEOUT_S = 30.0
LISTENING = "Azurite Blob service successfully listens on "


class AzuriteMissing(Exception):
    """Azurite (or node, or adlfs) is not installed where the tests look for it."""


@dataclass
class Azurite:
    process: subprocess.Popen[str]
    reader: threading.Thread
    endpoint: str
    directory: str

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
            f"BlobEndpoint={self.endpoint}/{ACCOUNT};"
        )

    def storage_options(self) -> dict[str, Any]:
        """adlfs options that reach this Azurite."""
        return {
            "connection_string": self.connection_string,
            "account_name": ACCOUNT,
            "skip_instance_cache": True,
        }

    def create_container(self, name: str) -> None:
        from azure.storage.blob import BlobServiceClient

        with BlobServiceClient.from_connection_string(self.connection_string) as client:
            client.create_container(name)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.reader.join(timeout=10)
        if self.process.stdout is not None:
            self.process.stdout.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def start_azurite() -> Azurite:
    """Start Azurite's blob service on 127.0.0.1 (an OS-chosen port), in memory."""
    node = shutil.which("node")
    if node is None or not SCRIPT.is_file():
        raise AzuriteMissing(f"Azurite is not installed in {INSTALL_DIR} (run: {INSTALL_HINT})")
    try:
        import adlfs  # noqa: F401
    except ImportError as exc:
        raise AzuriteMissing(f"{exc} (run: pip install adlfs)") from None
    directory = tempfile.mkdtemp(prefix="azurite-")
    command = [node, str(SCRIPT), "--blobHost", "127.0.0.1", "--blobPort", "0"]
    command += ["--inMemoryPersistence", "--skipApiVersionCheck", "--disableTelemetry"]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "NODE_NO_WARNINGS": "1"},
        cwd=directory,
    )
    endpoint: list[str] = []
    seen: list[str] = []
    listening = threading.Event()

    def read_output() -> None:
        # Reads to EOF, so a chatty server never blocks on a full pipe.
        assert process.stdout is not None
        for line in process.stdout:
            if not listening.is_set():
                seen.append(line)
                if line.startswith(LISTENING):
                    endpoint.append(line[len(LISTENING) :].strip())
                    listening.set()
        listening.set()

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    listening.wait(START_TIMEOUT_S)
    found = Azurite(process, reader, endpoint[0] if endpoint else "", directory)
    if not endpoint:
        found.stop()
        raise RuntimeError(f"Azurite did not start: {''.join(seen)[-2000:]}")
    return found
