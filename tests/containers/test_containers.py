"""docker/ built and run in real containers (podman, the image on a local Debian base):
compose.yaml's demo against an S3 server in a container, twice (the second run resumes);
the service profile, its trainer killed right after ``save()`` returned; ``ls`` and
``verify`` from the image against the bucket. Each mirrors a compose service; the podman
flags that stand for compose's keys are named where they are used."""

from __future__ import annotations

import json
import re
import shlex
import time

import pytest

from tests.containers.conftest import IMAGE, JOB, REPO, S3, Podman, compose_command

# A cold build (torch, then the project) takes minutes on a loaded machine; the fixtures'
# time counts against the first test's timeout.
pytestmark = [pytest.mark.containers, pytest.mark.timeout(1800)]

SOCKET_MOUNT = "/run/checkpointd"


def _demo(podman: Podman, s3: S3, run: int, *extra: str) -> str:
    command = [*compose_command("demo", s3), *extra]
    return podman.job(f"demo-{run}", "--network", s3.network, IMAGE, *command)


@pytest.fixture(scope="module")
def demo_runs(podman: Podman, s3: S3) -> tuple[str, str]:
    """compose's ``demo`` run twice in the image (shortened: later flags win)."""
    short = ("--steps=20", "--save-every=10", "--width=32")
    first = _demo(podman, s3, 1, *short)
    second = _demo(podman, s3, 2, "--steps=10", "--save-every=10", "--width=32")
    return first, second


def test_the_demo_runs_in_the_image_and_the_second_run_resumes(
    podman: Podman, demo_runs: tuple[str, str]
) -> None:
    first, second = demo_runs
    podman.expect("no checkpoint under s3://checkpoints/run" in first, first)
    podman.expect(
        re.search(r"step +20: blocked .* ms, durable after .* ms", first) is not None, first
    )
    podman.expect("resumed from step 20 at s3://checkpoints/run" in second, second)
    podman.expect("trained to step 30" in second, second)


def test_ls_and_verify_from_the_image_list_and_check_the_bucket(
    podman: Podman, s3: S3, demo_runs: tuple[str, str]
) -> None:
    listed = podman.job("ls", "--network", s3.network, IMAGE, *compose_command("ls", s3), "--json")
    steps = [entry["step"] for entry in json.loads(listed)]
    podman.expect(steps == [10, 20, 30], f"ls --json: {listed}")
    verify = compose_command("verify", s3)
    podman.expect("--all" in verify, f"compose's verify: {verify}")
    verified = podman.job("verify", "--network", s3.network, IMAGE, *verify, "--no-progress")
    podman.expect("verified 3 checkpoint(s)" in verified, verified)


def test_a_killed_trainer_container_commits_and_a_new_one_restores_from_memory(
    podman: Podman, s3: S3
) -> None:
    serve = compose_command("checkpointd")
    socket = serve[serve.index("--socket") + 1]
    root = "s3://checkpoints/run-service"
    volume = podman.volume("socket")  # compose: the checkpointd-socket volume
    service = podman.name("service")
    podman(
        "run", "--detach", "--name", service, "--network", s3.network,
        "--ipc", "shareable",  # compose: ipc: shareable
        "--volume", f"{volume}:{SOCKET_MOUNT}", IMAGE, *serve,
    )  # fmt: skip
    status = ["exec", service, "checkpointd", "status", "--socket", socket, "--json"]
    podman.wait_for("the service to answer", lambda: podman(*status, check=False).returncode == 0)

    trainer = [
        "--network", s3.network,
        "--ipc", f"container:{service}",  # compose: ipc: "service:checkpointd"
        "--volume", f"{volume}:{SOCKET_MOUNT}",
        "--volume", f"{REPO / 'tests' / 'containers' / 'job.py'}:{JOB}:ro",
        "--entrypoint", "python", IMAGE, JOB,
    ]  # fmt: skip
    killed = podman.name("trainer-killed")
    podman(
        "run", "--detach", "--name", killed, *trainer, "save", root, socket, "7", s3.options_json()
    )

    def returned() -> bool:
        if "returned 7" in podman("logs", killed).stdout:
            return True
        running = podman("inspect", "--format", "{{.State.Running}}", killed).stdout.strip()
        podman.expect(running == "true", f"the trainer {killed} exited before save() returned")
        return False

    podman.wait_for("save(7) to return in the trainer", returned)
    podman("kill", "--signal", "KILL", killed)

    def settled() -> dict[str, object] | None:
        reply: dict[str, object] = json.loads(podman(*status).stdout)
        return reply if reply["saves_in_flight"] == 0 and reply["kept"] else None

    reply = podman.wait_for("the killed trainer's save to commit", settled)
    podman.expect(reply["failed"] == 0 and reply["committed"] == 1, f"service status: {reply}")
    ls = ["exec", service, "checkpointd", "ls", root, *s3.options(), "--json"]
    listed = podman(*ls).stdout
    podman.expect([e["step"] for e in json.loads(listed)] == [7], f"ls --json: {listed}")

    restored = podman.job("trainer-restored", *trainer, "restore", root, socket, "7",
                          s3.options_json())  # fmt: skip
    outcome = json.loads(restored.strip().splitlines()[-1])
    podman.expect(
        outcome == {"step": 7, "source": "memory", "bit_exact": True}, f"restore: {restored}"
    )


def test_a_failing_container_shows_its_logs_in_the_failure(podman: Podman, s3: S3) -> None:
    command = ["verify", "s3://checkpoints/no-such-run", *s3.options()]
    started = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        podman.job("failing", "--network", s3.network, IMAGE, *command)
    message = str(failed.value)
    assert f"container cpd-failing-{podman.tag} exited" in message
    assert "no committed checkpoint under s3://" in message, message  # the CLI's own stderr
    assert f"--- logs of cpd-s3-{podman.tag}" in message  # and the S3 server's log
    assert time.monotonic() - started < 120, shlex.join(command)


def test_the_image_keeps_none_of_the_build_machines_pip_settings(podman: Podman) -> None:
    env = json.loads(podman("image", "inspect", "--format", "{{json .Config.Env}}", IMAGE).stdout)
    listed = podman.job("pip-config", "--entrypoint", "pip", IMAGE, "config", "list")
    handed = ("find-links", "index-url", "constraint", "cert", "FIND_LINKS", "INDEX_URL")
    for setting in handed:
        podman.expect(setting not in listed, f"pip config list in the image: {listed}")
        podman.expect(all(setting not in variable for variable in env), f"image env: {env}")
    podman.expect("no-cache-dir" in listed, f"pip config list in the image: {listed}")
