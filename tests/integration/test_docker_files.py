"""docker/ checked without a Docker engine: the compose file parses and wires MinIO, the
bucket and the demo together with real CLI flags; the Dockerfile's checkpointd steps and
the compose demo command run here (against moto instead of MinIO).

The image is built and run for real in tests/containers (podman, against moto's server
in a container); that MinIO accepts the requests only docker/smoke.sh checks, where a
registry serves MinIO's images.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import checkpointd
from checkpointd.cli import main as cli
from tests.conftest import Root

DOCKER = Path(__file__).resolve().parents[2] / "docker"
TOOLS = ("demo", "ls", "verify")


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    return loaded


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = (DOCKER / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    found = []
    for line in joined.splitlines():
        if line.strip():
            instruction, _, rest = line.strip().partition(" ")
            found.append((instruction.upper(), rest.strip()))
    return found


def test_compose_wires_minio_the_bucket_and_the_tools() -> None:
    services = compose()["services"]
    assert set(TOOLS) | {"minio", "create-bucket"} <= services.keys()
    minio = services["minio"]
    user = minio["environment"]["MINIO_ROOT_USER"]
    password = minio["environment"]["MINIO_ROOT_PASSWORD"]
    assert "9000:9000" in minio["ports"]
    assert minio["command"][:2] == ["server", "/data"]

    bucket_job = services["create-bucket"]
    assert bucket_job["depends_on"]["minio"]["condition"] == "service_healthy"
    script = " ".join(bucket_job["command"])
    assert f"mc alias set local http://minio:9000 {user} {password}" in script
    match = re.search(r"mc mb --ignore-existing local/(\S+)", script)
    assert match is not None
    bucket = match.group(1)

    demo = services["demo"]
    assert demo["depends_on"]["create-bucket"]["condition"] == "service_completed_successfully"
    assert (DOCKER / demo["build"]["context"] / demo["build"]["dockerfile"]).is_file()
    parser = cli.build_parser()
    for name in TOOLS:
        service = services[name]
        assert service["image"] == demo["image"]
        args = parser.parse_args(service["command"])  # unknown flags would exit here
        assert args.command == name
        assert args.root == f"s3://{bucket}/run"
        assert cli.storage_options(args) == {
            "key": user,
            "secret": password,
            "client_kwargs": {"endpoint_url": "http://minio:9000", "region_name": "us-east-1"},
        }


def test_dockerfile_installs_cpu_torch_first_then_the_dependencies_then_the_project() -> None:
    steps = dockerfile_instructions()
    build_args = dict(a.partition("=")[::2] for kind, a in steps if kind == "ARG")
    assert build_args["BASE"] == "python:3.11-slim"  # users; the containers tier passes its own
    assert build_args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    stages = [i for i, (kind, _) in enumerate(steps) if kind == "FROM"]
    assert [steps[i][1] for i in stages] == ["${BASE} AS requirements", "${BASE}"]
    final = steps[stages[-1] :]
    runs = [args for instruction, args in final if instruction == "RUN"]
    torch_step = next(i for i, r in enumerate(runs) if "torch==" in r)
    deps_step = next(i for i, r in enumerate(runs) if "-r /tmp/requirements.txt" in r)
    project_step = next(i for i, r in enumerate(runs) if "'.[s3]'" in r)
    assert torch_step < deps_step < project_step
    assert "pip install torch==2.13.0" in runs[torch_step]
    assert '--index-url "$TORCH_INDEX_URL"' in runs[torch_step]
    assert "--no-deps" in runs[project_step]
    assert ("COPY", "--from=requirements /requirements.txt /tmp/requirements.txt") in final
    # the build machine's pip settings are build arguments, never the image's environment
    env = " ".join(args for instruction, args in steps if instruction == "ENV")
    for name in ("PIP_INDEX_URL", "PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT"):
        assert name in build_args
        assert name not in env
    copied = [src for kind, args in steps if kind == "COPY" for src in args.split()[:-1]]
    for source in ("pyproject.toml", "README.md", "src"):
        assert source in copied
        assert (DOCKER.parent / source).exists()
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
    assert "**" in ignore
    assert {"!pyproject.toml", "!README.md", "!src/**"} <= set(ignore)


def test_dockerfile_requirements_stage_lists_what_pyproject_requires(tmp_path: Path) -> None:
    steps = dockerfile_instructions()
    stages = [i for i, (kind, _) in enumerate(steps) if kind == "FROM"]
    first_stage = steps[stages[0] : stages[1]]
    (command,) = [args for kind, args in first_stage if kind == "RUN"]
    # the stage's python3 reads /pyproject.toml: here, the repository's
    script = command.replace("/pyproject.toml", str(DOCKER.parent / "pyproject.toml"))
    script = script.replace("python3", sys.executable, 1).replace("/requirements.txt", "out.txt")
    done = subprocess.run(
        ["bash", "-ec", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    listed = (tmp_path / "out.txt").read_text().splitlines()
    assert {"torch>=2.4", "s3fs>=2024.6"} <= set(listed)
    assert any(line.startswith("setuptools") for line in listed)  # --no-build-isolation


def test_dockerfile_checkpointd_steps_run_outside_docker() -> None:
    steps = dockerfile_instructions()
    smoke = [args for instruction, args in steps if instruction == "RUN" and "checkpointd" in args]
    assert smoke, "the Dockerfile should smoke-test the installed command"
    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    for command in smoke:
        assert "pip" not in command
        done = subprocess.run(
            ["bash", "-ec", command],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert "usage: checkpointd" in done.stdout

    entrypoint = next(args for instruction, args in steps if instruction == "ENTRYPOINT")
    cmd = next(args for instruction, args in steps if instruction == "CMD")
    assert yaml.safe_load(entrypoint) == ["checkpointd"]
    args = cli.build_parser().parse_args(yaml.safe_load(cmd))
    assert (args.command, args.root) == ("demo", "/work/checkpoints")


def _for_moto(command: list[str], root: Root) -> list[str]:
    """The compose command with moto's bucket, endpoint and credentials instead of MinIO's."""
    kept = [a for a in command if not a.startswith("--storage-option")]
    kept = [root.url if a.startswith("s3://") else a for a in kept]
    assert root.storage_options is not None
    endpoint = root.storage_options["client_kwargs"]["endpoint_url"]
    return [
        *kept,
        f"--storage-option=key={root.storage_options['key']}",
        f"--storage-option=secret={root.storage_options['secret']}",
        f"--storage-option=client_kwargs.endpoint_url={endpoint}",
        "--storage-option=client_kwargs.region_name=us-east-1",
        "--storage-option=skip_instance_cache=true",
    ]


@pytest.mark.timeout(240)
def test_compose_demo_command_runs_against_s3(
    s3_root: Root, capsys: pytest.CaptureFixture[str]
) -> None:
    services = compose()["services"]
    demo = _for_moto(services["demo"]["command"], s3_root)
    # The compose command, shortened (later flags win) so the test stays quick.
    command = [sys.executable, "-m", "checkpointd", *demo, "--steps=10", "--save-every=10"]
    command.append("--width=32")
    done = subprocess.run(command, capture_output=True, text=True, timeout=200, check=False)
    assert done.returncode == 0, f"{shlex.join(command)}\n{done.stdout}\n{done.stderr}"
    assert "no checkpoint under s3://" in done.stdout
    assert re.search(r"step +10: blocked .* ms, durable after .* ms", done.stdout)
    infos = checkpointd.list_checkpoints(s3_root.url, storage_options=s3_root.storage_options)
    assert [info.step for info in infos] == [10]

    verify = _for_moto(services["verify"]["command"], s3_root)
    assert cli.main(verify) == 0
    assert "verified 1 checkpoint(s)" in capsys.readouterr().out


def test_compose_runs_the_service_as_a_sidecar() -> None:
    services = compose()["services"]
    sidecar, trainer = services["checkpointd"], services["demo-service"]
    assert sidecar["ipc"] == "shareable"
    assert trainer["ipc"] == "service:checkpointd"
    assert trainer["depends_on"]["checkpointd"]["condition"] == "service_started"
    assert sidecar["image"] == trainer["image"] == services["demo"]["image"]
    parser = cli.build_parser()
    serve = parser.parse_args(sidecar["command"])
    demo = parser.parse_args(trainer["command"])
    assert serve.command == "serve"
    assert demo.command == "demo"
    assert demo.service == serve.socket
    (volume,) = sidecar["volumes"]
    assert volume in trainer["volumes"]
    name, _, mount = volume.partition(":")
    assert name in compose()["volumes"]
    # the socket's own folder is made 0700 by the service, below the shared volume
    assert os.path.dirname(os.path.dirname(serve.socket)) == mount


@pytest.mark.timeout(240)
def test_compose_service_demo_runs_against_s3_through_a_service(
    s3_root: Root, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.support.service import running_service

    services = compose()["services"]
    demo = _for_moto(services["demo-service"]["command"], s3_root)
    with running_service() as service:
        demo = [f"--service={service.socket}" if a.startswith("--service") else a for a in demo]
        command = [sys.executable, "-m", "checkpointd", *demo, "--steps=10", "--save-every=10"]
        command.append("--width=32")
        for expected in ("no checkpoint under s3://", "from memory"):
            done = subprocess.run(command, capture_output=True, text=True, timeout=200, check=False)
            assert done.returncode == 0, f"{shlex.join(command)}\n{done.stdout}\n{done.stderr}"
            assert expected in done.stdout
    infos = checkpointd.list_checkpoints(s3_root.url, storage_options=s3_root.storage_options)
    assert [info.step for info in infos] == [10, 20]
