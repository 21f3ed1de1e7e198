"""What a save logs (issue 32): its lifecycle in order, each line under the name of the
module that did the work, a failure's reason at WARNING, retention's deletions, and
never a storage option's value or a URL's credentials."""

from __future__ import annotations

import logging
import uuid

import pytest
import torch

import checkpointd
from checkpointd.format.layout import step_dirname
from checkpointd.storage.base import shown
from tests.conftest import Root

SECRET = f"secret-{uuid.uuid4().hex}"
PASSWORD = f"pw{uuid.uuid4().hex[:12]}"


def _state(value: float) -> dict[str, object]:
    return {"model": {"w": torch.full((64,), value), "b": torch.zeros(3)}, "epoch": int(value)}


def _records(caplog: pytest.LogCaptureFixture) -> list[tuple[str, int, str]]:
    return [
        (r.name, r.levelno, r.getMessage())
        for r in caplog.records
        if r.name.startswith("checkpointd")
    ]


def _index(records: list[tuple[str, int, str]], name: str, level: int, text: str) -> int:
    found = [i for i, (n, lv, m) in enumerate(records) if n == name and lv == level and text in m]
    assert found, (name, text, records)
    return found[0]


def test_a_save_logs_its_lifecycle_in_order_under_each_modules_name(
    local_root: Root, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="checkpointd")
    with checkpointd.CheckpointWriter(local_root.url, keep_last=1) as writer:
        writer.save(1, _state(1.0)).result(60)
        caplog.clear()
        writer.save(2, _state(2.0)).result(60)
    records = _records(caplog)
    debug, info = logging.DEBUG, logging.INFO
    started = _index(records, "checkpointd.api.writer_base", debug, "step 2 of ")
    assert local_root.url in records[started][2]
    staged = _index(records, "checkpointd.api.writer_base", debug, "step 2: staged")
    durable = [
        i
        for i, (n, lv, m) in enumerate(records)
        if n == "checkpointd.write.commit" and lv == debug and " durable (" in m
    ]
    published = _index(records, "checkpointd.write.commit", debug, "step 2: manifest published")
    deleted = _index(records, "checkpointd.maintain.retention", info, "deleted steps 1 of ")
    committed = _index(records, "checkpointd.write.handle", info, "committed step 2 to ")
    assert started < staged < min(durable) <= max(durable) < published < deleted < committed
    assert "keep_last=1" in records[deleted][2]
    # nothing above DEBUG but the outcome and retention's deletion
    assert [(n, m.split(" (")[0]) for n, lv, m in records if lv > debug] == [
        ("checkpointd.maintain.retention", f"retention deleted steps 1 of {local_root.url}"),
        ("checkpointd.write.handle", f"committed step 2 to {local_root.url}"),
    ]


def test_a_failed_save_logs_its_reason_at_warning(
    local_root: Root, caplog: pytest.LogCaptureFixture
) -> None:
    first = checkpointd.CheckpointWriter(local_root.url)
    second = checkpointd.CheckpointWriter(local_root.url)  # opened before step 1 commits
    with first, second:
        first.save(1, _state(1.0)).result(60)
        caplog.set_level(logging.INFO, logger="checkpointd")
        with pytest.raises(checkpointd.CheckpointExistsError):
            second.save(1, _state(1.0)).result(60)
    warnings = [(n, m) for n, lv, m in _records(caplog) if lv == logging.WARNING]
    assert warnings == [
        (
            "checkpointd.write.handle",
            f"step 1 of {local_root.url} failed: step 1 is already committed at "
            f"{local_root.url}/{step_dirname(1)}",
        )
    ]


def test_no_log_record_carries_a_storage_option_value_or_a_urls_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import tests.support.dict_store  # noqa: F401 - registers dictfs://

    root = f"dictfs://ckpt:{PASSWORD}@ckpt-{uuid.uuid4().hex[:12]}/run"
    options = {"key": "AKID", "secret": SECRET}
    caplog.set_level(logging.DEBUG, logger="checkpointd")
    first = checkpointd.CheckpointWriter(root, storage_options=options, keep_last=1)
    second = checkpointd.CheckpointWriter(root, storage_options=options)
    with first, second:
        for step in (1, 2, 3):
            first.save(step, _state(float(step))).result(60)
        with pytest.raises(checkpointd.CheckpointExistsError):
            second.save(3, _state(3.0)).result(60)
    records = [r for r in caplog.records if r.name.startswith("checkpointd")]
    names = {r.name for r in records}
    assert {"checkpointd.write.handle", "checkpointd.maintain.retention"} <= names
    assert any(r.levelno == logging.WARNING for r in records)  # the failure is in there
    assert any("dictfs://***@ckpt-" in r.getMessage() for r in records)  # the root, as shown
    for record in records:
        text = f"{record.getMessage()} {record.args!r} {record.exc_text or ''}"
        assert SECRET not in text, text
        assert PASSWORD not in text, text


def test_shown_masks_every_urls_credentials_and_query() -> None:
    text = (
        f"failed at s3://AKID:{SECRET}@host/b/run/step-1 and https://h/o?X-Amz-Signature={SECRET}"
    )
    assert shown(text) == "failed at s3://***@host/b/run/step-1 and https://h/o?***"
    assert shown("/data/run: no such file") == "/data/run: no such file"
    assert shown("gs://bucket/run") == "gs://bucket/run"
