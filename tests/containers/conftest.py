"""The containers tier: docker/'s image built and run with podman, against moto's S3 server
in a container built on the same local base. ``.ci/containers`` installs the engine and
builds the base; without it every test here skips, saying why.

Every container a test starts is named and kept until the session ends, so a failure's
message carries the logs of the containers it involved.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlparse

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
STATE = REPO / ".cache" / "containers"
IMAGE = "localhost/checkpointd:test"
MOTO_IMAGE = "localhost/checkpointd-moto:test"
BUCKET = "checkpoints"
JOB = "/job/job.py"
# moto accepts any credentials; MinIO's from compose.yaml are swapped for these.
KEY, SECRET = "checkpointd", "checkpointd-secret"
LOG_TAIL = 4000


@dataclass
class Podman:
    """podman commands, run with the tier's containers.conf; remembers what it started."""

    env: dict[str, str]
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    started: list[str] = field(default_factory=list)
    volumes: list[str] = field(default_factory=list)
    servers: list[str] = field(default_factory=list)
    """Containers every test involves (the S3 server)."""
    involved: list[str] = field(default_factory=list)
    """The containers the running test started: their logs go into its failure messages."""

    def __call__(
        self, *args: str, timeout: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """``podman ARGS``, output captured; fails the test (with logs) on a non-zero exit."""
        with (STATE / "commands.log").open("a") as log:  # what ran, for the docs and CI
            log.write(shlex.join(["podman", *args]) + "\n")
        done = subprocess.run(
            ["podman", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            self.fail(f"podman {shlex.join(args)} exited {done.returncode}", done)
        return done

    def name(self, role: str, server: bool = False) -> str:
        """A container name for ``role``, unique to this session, its logs kept for failures."""
        name = f"cpd-{role}-{self.tag}"
        self.started.append(name)
        (self.servers if server else self.involved).append(name)
        return name

    def volume(self, role: str) -> str:
        """A new named volume, removed at the session's end."""
        name = f"cpd-{role}-{self.tag}"
        self("volume", "create", name)
        self.volumes.append(name)
        return name

    def logs(self, name: str) -> str:
        done = self("logs", name, check=False)
        text = (done.stdout + done.stderr)[-LOG_TAIL:]
        return f"--- logs of {name} (last {LOG_TAIL} characters) ---\n{text}"

    def fail(self, message: str, done: subprocess.CompletedProcess[str] | None = None) -> NoReturn:
        """Fail the test with ``message``, the command's output and every involved log."""
        parts = [message]
        if done is not None:
            parts.append(f"--- stdout ---\n{done.stdout[-LOG_TAIL:]}")
            parts.append(f"--- stderr ---\n{done.stderr[-LOG_TAIL:]}")
        parts.extend(self.logs(name) for name in [*self.involved, *self.servers])
        raise AssertionError("\n".join(parts))

    def expect(self, condition: bool, message: str) -> None:
        """Assert ``condition``; if false, fail with every involved container's logs."""
        if not condition:
            self.fail(message)

    def job(self, role: str, *run_args: str, timeout: float = 300) -> str:
        """Run a container to its end (``podman run RUN_ARGS``); its output, or the test
        fails with its logs."""
        name = self.name(role)
        done = self("run", "--name", name, *run_args, timeout=timeout, check=False)
        if done.returncode != 0:
            self.fail(f"container {name} exited {done.returncode}", done)
        return done.stdout

    def wait_for(self, what: str, probe: Any, timeout: float = 120) -> Any:
        """Poll ``probe()`` until it returns something truthy; fail with logs after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            found = probe()
            if found:
                return found
            if time.monotonic() > deadline:
                self.fail(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(0.5)


def _engine_env() -> dict[str, str]:
    ready = STATE / "ready"
    if not ready.is_file():
        skipped = STATE / "skipped"
        reason = skipped.read_text().strip() if skipped.is_file() else "it has not been run"
        pytest.skip(f"containers tier: no container engine (.ci/containers: {reason})")
    return {**os.environ, "CONTAINERS_CONF": str(STATE / "containers.conf")}


def pip_settings() -> tuple[list[str], list[str]]:
    """The build arguments and read-only volumes that hand this machine's pip configuration
    (wheel folders, local indexes, constraints, CA bundle) to a build's RUN steps."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    settings: dict[str, str] = {}
    # global.find-links='/opt/wheels', ..., then the PIP_* variables as :env:.find-links=...
    for line in listed.splitlines():  # later lines win
        key, _, value = line.partition("=")
        settings[key.rpartition(".")[2]] = value.strip("'\"")
    build_args: list[str] = []
    volumes: set[str] = set()
    for key in ("find-links", "extra-index-url", "index-url", "constraint", "cert"):
        kept = []
        for item in settings.get(key, "").split():
            path = urlparse(item).path if item.startswith("file:") else item
            if "://" in item and not item.startswith("file:"):
                kept.append(item)  # a remote index: reachable from the build as from here
            elif os.path.exists(path):
                kept.append(item)
                # a local index's pages link to files beside it (../files/...): its parent
                shared = os.path.dirname(path.rstrip("/")) if key.endswith("index-url") else path
                volumes.add(f"{shared}:{shared}:ro")
        if kept:
            build_args += ["--build-arg", f"PIP_{key.upper().replace('-', '_')}={' '.join(kept)}"]
    return build_args, [arg for volume in sorted(volumes) for arg in ("--volume", volume)]


def _moto_requirements() -> str:
    from importlib.metadata import version

    return " ".join(
        f"{name}=={version(name)}" for name in ("moto", "flask", "flask-cors", "werkzeug")
    ).replace("moto==", "moto[s3]==")


@pytest.fixture(scope="session")
def podman() -> Iterator[Podman]:
    """The engine, the two images built (layers cached between runs), a network for the
    session; every container, volume and the network removed at the end."""
    engine = Podman(_engine_env())
    (STATE / "commands.log").write_text("")
    base = (STATE / "ready").read_text().strip()
    build_args, volumes = pip_settings()
    common = ["build", "--layers", "--build-arg", f"BASE={base}", *build_args, *volumes]
    engine(
        *common,
        "--build-arg",
        "TORCH_INDEX_URL=",  # torch==2.13.0 as pip resolves it here, not the CPU index
        "--file",
        str(REPO / "docker" / "Dockerfile"),
        "--ignorefile",
        str(REPO / "docker" / "Dockerfile.dockerignore"),
        "--tag",
        IMAGE,
        str(REPO),
        timeout=1500,
    )
    engine(
        *common,
        "--build-arg",
        f"MOTO_REQUIREMENTS={_moto_requirements()}",
        "--file",
        str(REPO / "tests" / "containers" / "moto.Dockerfile"),
        "--tag",
        MOTO_IMAGE,
        str(REPO / "tests" / "containers"),
        timeout=600,
    )
    network = f"cpd-net-{engine.tag}"
    engine("network", "create", network)
    try:
        yield engine
    finally:
        for name in engine.started:
            engine("rm", "--force", "--time", "1", name, check=False)
        engine("network", "rm", "--force", network, check=False)
        for volume in engine.volumes:
            engine("volume", "rm", "--force", volume, check=False)


@pytest.fixture(autouse=True)
def _involved(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test's failure messages carry the logs of its own containers and the S3 server."""
    if "podman" not in request.fixturenames:
        yield
        return
    engine: Podman = request.getfixturevalue("podman")
    engine.involved = []
    yield
    engine.involved = []


@dataclass(frozen=True)
class S3:
    """moto's server in a container on the session's network, with the bucket made."""

    network: str
    endpoint: str
    container: str

    def options(self) -> list[str]:
        """The ``--storage-option`` flags that reach this server from the network."""
        return [
            f"--storage-option=key={KEY}",
            f"--storage-option=secret={SECRET}",
            f"--storage-option=client_kwargs.endpoint_url={self.endpoint}",
            "--storage-option=client_kwargs.region_name=us-east-1",
        ]

    def options_json(self) -> str:
        kwargs = {"endpoint_url": self.endpoint, "region_name": "us-east-1"}
        return json.dumps({"key": KEY, "secret": SECRET, "client_kwargs": kwargs})


@pytest.fixture(scope="session")
def s3(podman: Podman) -> S3:
    network = f"cpd-net-{podman.tag}"
    name = podman.name("s3", server=True)
    podman("run", "--detach", "--name", name, "--network", network, MOTO_IMAGE)
    endpoint = f"http://{name}:5000"
    python = "/opt/moto/bin/python"
    answers = "import urllib.request as u; u.urlopen('http://127.0.0.1:5000/', timeout=5)"
    podman.wait_for(
        "moto's server to answer",
        lambda: podman("exec", name, python, "-c", answers, check=False).returncode == 0,
    )
    make = f"import urllib.request as u; u.urlopen(u.Request('http://127.0.0.1:5000/{BUCKET}', method='PUT'))"
    podman("exec", name, python, "-c", make)
    return S3(network, endpoint, name)


def compose_command(service: str, s3: S3 | None = None) -> list[str]:
    """compose.yaml's command for ``service``; with ``s3``, MinIO's storage options swapped
    for that server's."""
    services = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())["services"]
    command: list[str] = services[service]["command"]
    if s3 is None:
        return command
    return [arg for arg in command if not arg.startswith("--storage-option")] + s3.options()
