"""A relative root means the trainer's folder, also through the checkpoint service.

The service runs in a working folder of its own (``checkpointd serve`` started
elsewhere, or ``service="auto"`` started by another job): a trainer resolves its root
before anything is sent, and the service refuses a relative one.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import checkpointd
from checkpointd.daemon.client.client import Connection, status
from checkpointd.daemon.wire import protocol as p
from tests.support import zygote
from tests.support.service import auto_socket_env, child_env, running_service
from tests.support.service_jobs import expected_state


@pytest.fixture
def served_elsewhere(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """``checkpointd serve`` started in its own folder ``tmp_path/x``: its socket, folder."""
    there = tmp_path / "x"
    there.mkdir()
    with running_service(cwd=there) as service:
        try:
            yield service.socket, there
        finally:
            print(service.log_text())  # shown on failure


@pytest.fixture
def auto_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with auto_socket_env(monkeypatch) as socket:
        yield socket


def _job(cwd: Path, service: str, root: str, *args: object) -> dict[str, object]:
    """tests.support.root_job run in ``cwd``; its JSON line."""
    done = zygote.run(
        [sys.executable, "-m", "tests.support.root_job", service, root, *map(str, args)],
        env=child_env(),
        cwd=cwd,
        check=False,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def _here(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    return folder


def test_a_relative_root_through_a_socket_is_the_trainers_folder(
    served_elsewhere: tuple[str, Path], tmp_path: Path
) -> None:
    socket, there = served_elsewhere
    here = _here(tmp_path, "y")
    assert _job(here, socket, "ckpt", "save", 1, 5) == {"listed": [5]}
    assert (here / "ckpt" / f"{5:012d}" / "manifest.json").is_file()
    assert not (there / "ckpt").exists()
    restored = _job(here, socket, "ckpt", "restore", 1)
    assert restored == {"step": 5, "source": "memory", "own": True, "listed": [5]}


def test_two_jobs_with_one_relative_root_keep_apart_through_auto(
    auto_socket: str, tmp_path: Path
) -> None:
    first, second = _here(tmp_path, "a"), _here(tmp_path, "b")
    # The first job starts the service, in its own folder; the second uses that service.
    assert _job(first, "auto", "ckpt", "save", 1, 3) == {"listed": [3]}
    assert _job(second, "auto", "ckpt", "save", 2, 3) == {"listed": [3]}
    for folder, seed in ((first, 1), (second, 2)):
        assert (folder / "ckpt" / f"{3:012d}" / "manifest.json").is_file()
        restored = _job(folder, "auto", "ckpt", "restore", seed)
        assert restored == {"step": 3, "source": "memory", "own": True, "listed": [3]}


def test_the_service_refuses_a_relative_root_and_keeps_serving(
    served_elsewhere: tuple[str, Path], tmp_path: Path
) -> None:
    socket, there = served_elsewhere
    for kind, fields in (
        (p.OpenWriter, {}),
        (p.Lookup, {"storage_options": None, "step": 1}),
        (p.OpenWriter, {"root": "~/ckpt"}),
        (p.OpenWriter, {"root": "file://ckpt"}),
    ):
        conn = Connection(socket)
        try:
            with pytest.raises(p.ProtocolError, match="is not absolute"):
                conn.request(kind, **{"root": "ckpt", **fields})
        finally:
            conn.close()
    assert not (there / "ckpt").exists()
    root = str(tmp_path / "r")
    with checkpointd.CheckpointWriter(root, service=socket) as writer:
        writer.save(1, {"model": expected_state(1)}).result(60)
    assert [c.step for c in checkpointd.list_checkpoints(root)] == [1]
    assert status(socket).committed == 1


def test_the_demo_through_a_service_resumes_in_its_own_folder(
    served_elsewhere: tuple[str, Path], tmp_path: Path
) -> None:
    socket, there = served_elsewhere
    here = _here(tmp_path, "y")
    command = [sys.executable, "-m", "checkpointd", "demo", "ckpt", "--service", socket]
    command += ["--steps", "4", "--save-every", "2", "--width", "16"]
    outs = []
    for _ in range(2):
        done = zygote.run(
            command,
            env=child_env(),
            cwd=here,
            check=False,
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert done.returncode == 0, done.stderr
        outs.append(done.stdout)
    assert "starting fresh" in outs[0]
    assert f"resumed from step 4 at {here / 'ckpt' / f'{4:012d}'} from memory" in outs[1]
    assert not (there / "ckpt").exists()


def test_a_trainers_default_root_under_a_relative_output_dir_is_its_own(
    served_elsewhere: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    from checkpointd.integrations.transformers import CheckpointdTrainer
    from tests.support import transformers_job

    socket, there = served_elsewhere
    here = _here(tmp_path, "y")
    monkeypatch.chdir(here)
    trainer = CheckpointdTrainer(
        model=transformers_job.model(),
        args=transformers_job.arguments("out", max_steps=4),  # saves at step 4
        train_dataset=transformers_job.Tokens(),
        checkpointd_options={"service": socket},
    )
    monkeypatch.chdir(there)  # the process moves on: its root does not
    trainer.train()
    assert trainer.checkpointd_root == str(here / "out" / "checkpointd")
    assert [c.step for c in checkpointd.list_checkpoints(str(here / "out" / "checkpointd"))] == [4]
    assert not (there / "out" / "checkpointd").exists()
