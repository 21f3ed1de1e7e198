"""The service never shows a root's storage options' values (credentials): not in
``checkpointd status`` (plain or ``--json``), not in its log, not when a save fails.
A writer saves to S3 (moto's server) through a real ``checkpointd serve`` with a
key and secret that moto accepts as any other."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

import checkpointd
from checkpointd.errors import CheckpointExistsError
from tests.support.s3 import REGION, MotoS3
from tests.support.service import run_python, running_service
from tests.support.service_jobs import expected_state

KEY = f"AKIDKEY{uuid.uuid4().hex[:12].upper()}"
SECRET = f"secret-{uuid.uuid4().hex}"
TOKEN = f"token-{uuid.uuid4().hex}"


def _options(moto_s3: MotoS3) -> dict[str, object]:
    return {
        "key": KEY,
        "secret": SECRET,
        "token": TOKEN,
        "client_kwargs": {"endpoint_url": moto_s3.endpoint, "region_name": REGION},
        "skip_instance_cache": True,
    }


def _assert_no_secret(text: str) -> None:
    for secret in (KEY, SECRET, TOKEN):
        assert secret not in text


def test_status_and_log_never_show_storage_credentials(moto_s3: MotoS3) -> None:
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    moto_s3.create_bucket(bucket)
    root, options = f"s3://{bucket}/run", _options(moto_s3)
    with running_service() as service:
        first, second = (
            checkpointd.CheckpointWriter(root, storage_options=options, service=service.socket)
            for _ in range(2)
        )
        with first, second:
            first.save(1, {"model": expected_state(1)}).result(60)
            # the second, opened before step 1 was, saves it too: its save fails in the
            # service, at the commit
            with pytest.raises(CheckpointExistsError):
                second.save(1, {"model": expected_state(1)}).result(60)
        command = ("-m", "checkpointd", "status", "--socket", service.socket)
        shown = run_python(*command, "--json", check=True).stdout
        text = run_python(*command, check=True).stdout
        log = service.log_text()
    _assert_no_secret(shown + text + log)
    names = "storage options: client_kwargs, key, secret, skip_instance_cache, token"
    assert json.loads(shown)["kept"] == {f"{root} ({names})": [1]}
    assert f"kept in memory: {root} ({names}): steps 1" in text
    (failed,) = [line for line in log.splitlines() if "step 1 of" in line]
    assert f"step 1 of {root} ({names}) failed: step 1 is already committed" in failed


def test_a_status_from_an_older_service_is_shown_without_credentials(
    tmp_path: Path,
) -> None:
    """A service started before this version (auto-started ones live on) sends each
    root with its storage options' JSON: ``checkpointd status`` still shows no value."""
    from checkpointd.daemon.server.memtier import shown_key

    old = f's3://b/run {{"key":"{KEY}","secret":"{SECRET} {{x}}"}}'
    assert shown_key(old) == "s3://b/run (storage options: key, secret)"
    assert shown_key("/data/run {}") == "/data/run"
    assert shown_key(str(tmp_path)) == str(tmp_path)
