"""WriterOptions: one frozen, checked object for every writer option, made from the
writer's keywords and from the framework plugins' (write/options.py)."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpointd import (
    AsyncCheckpointWriter,
    CheckpointWriter,
    InvalidArgumentError,
    RetentionPolicy,
    load,
    tunables,
)
from checkpointd.api.writer_base import WriterBase
from checkpointd.write.options import WriterKeywords, WriterOptions


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_pending": 0}, "max_pending must be a positive int, not 0"),
        ({"max_concurrency": True}, "max_concurrency must be a positive int, not True"),
        ({"chunk_bytes": 0}, "chunk_bytes must be a positive int, not 0"),
        ({"chunk_bytes": 1.5}, "chunk_bytes must be a positive int, not 1.5"),
        ({"join_seconds": 0}, "join_seconds must be a positive number of seconds, not 0"),
        ({"join_seconds": "10"}, "join_seconds must be a positive number of seconds, not '10'"),
        ({"background_niceness": 20}, "background_niceness must be an int from 0 to 19, not 20"),
        ({"incremental": 1}, "incremental must be a bool, not 1"),
        (
            {"newer_steps": "sometimes"},
            "newer_steps must be one of ('error', 'keep', 'discard'), not 'sometimes'",
        ),
        (
            {"staging": "lazy"},
            "staging must be one of ('blocking', 'overlapped'), not 'lazy'",
        ),
        (
            {"storage_options": [("anon", True)]},
            "storage_options must be a mapping with str keys or None",
        ),
        ({"service": 3}, 'service must be None, "auto" or a socket path, not 3'),
        ({"buffer_pool": []}, "buffer_pool must be a BufferPool or None, not list"),
        ({"keep_last": 0}, "keep_last must be a positive int or None, not 0"),
        ({"keep_best": 2}, "keep_best needs best_metric"),
        ({"best_mode": "median"}, "best_mode must be 'min' or 'max', not 'median'"),
        ({"retention": {"keep_last": 2}}, "retention must be a RetentionPolicy, not dict"),
        (
            {"retention": RetentionPolicy(keep_last=2), "keep_every": 10},
            "pass retention=RetentionPolicy(...) or keep_last/keep_every/keep_best/"
            "best_metric/best_mode, not both",
        ),
    ],
)
def test_a_bad_option_is_refused_with_a_message_naming_it(
    tmp_path: Path, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidArgumentError) as made:
        WriterOptions(**options)
    assert str(made.value).startswith(message)
    with pytest.raises(InvalidArgumentError) as written:
        CheckpointWriter(str(tmp_path), **options)
    assert str(written.value) == str(made.value)
    assert list(tmp_path.iterdir()) == []  # refused before the root was touched


def test_options_are_frozen_normalized_and_replaced_with_a_check(tmp_path: Path) -> None:
    given = {"endpoint_url": "http://x"}
    options = WriterOptions(storage_options=given, service=tmp_path / "sock", keep_last=2)
    given["endpoint_url"] = "changed"
    assert options.storage_options == {"endpoint_url": "http://x"}
    assert options.service == str(tmp_path / "sock")
    assert options.policy == RetentionPolicy(keep_last=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.max_pending = 3  # type: ignore[misc]
    assert options.replace(max_pending=3).max_pending == 3
    with pytest.raises(InvalidArgumentError, match="max_pending"):
        options.replace(max_pending=-1)
    assert WriterOptions(**options.keywords()) == options


def test_tunables_are_the_defaults_when_the_options_are_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tunables, "CHUNK_BYTES", 12345)
    monkeypatch.setattr(tunables, "JOIN_SECONDS", 7.5)
    assert (WriterOptions().chunk_bytes, WriterOptions().join_seconds) == (12345, 7.5)
    with (
        CheckpointWriter(str(tmp_path / "a")) as default,
        CheckpointWriter(str(tmp_path / "b"), chunk_bytes=4096, join_seconds=2.0) as tuned,
    ):
        assert (default.options.chunk_bytes, default.options.join_seconds) == (12345, 7.5)
        assert (tuned.options.chunk_bytes, tuned.options.join_seconds) == (4096, 2.0)
        tuned.save(1, {"w": torch.arange(10_000, dtype=torch.float64)}).result(timeout=60)
    assert load(str(tmp_path / "b")).state["w"].equal(torch.arange(10_000, dtype=torch.float64))


def test_the_writer_the_options_and_the_typed_keywords_list_the_same_options() -> None:
    """Three lists of one set of names (the writer's signature is the documented API, the
    TypedDict types a plugin's ``**writer_options``): they cannot drift apart."""
    fields = {f.name: f for f in dataclasses.fields(WriterOptions) if f.init}
    keywords = typing.get_type_hints(WriterKeywords)
    for writer in (CheckpointWriter, AsyncCheckpointWriter):
        parameters = inspect.signature(writer).parameters
        assert set(parameters) - {"root"} == set(fields)
    assert set(keywords) == set(fields)
    parameters = inspect.signature(WriterBase).parameters
    for name, f in fields.items():
        if f.default is not dataclasses.MISSING:
            assert parameters[name].default == f.default, name
        else:  # read from tunables when made: the writer says so with None
            assert parameters[name].default is None, name
