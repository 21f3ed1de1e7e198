"""Backends chosen by URL protocol: built in, registered, or from an entry point on first use."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest
from fsspec.exceptions import BlocksizeMismatchError

import checkpointd.storage
from checkpointd.errors import StorageError
from checkpointd.storage import FsspecStore, LocalStore, open_store, register_store
from tests.support.dict_store import DictStore


def test_each_protocol_opens_its_backend(tmp_path: object) -> None:
    assert type(open_store(str(tmp_path))) is LocalStore
    assert type(open_store(f"file://{tmp_path}")) is LocalStore
    assert type(open_store("memory://reg")) is FsspecStore  # generic fsspec
    assert type(open_store("dictfs://reg")) is DictStore  # registered by its module


def test_an_entry_point_is_loaded_only_when_its_protocol_is_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(checkpointd.storage, "_registry", dict(checkpointd.storage._registry))  # noqa: SLF001 - isolates the registry the test fills
    asked: list[str] = []

    def entry_points(*, group: str, name: str) -> list[EntryPoint]:
        asked.append(name)
        assert group == "checkpointd.stores"
        value = "tests.support.dict_store:DictStore"
        return [EntryPoint(name, value, group)] if name == "epfs" else []

    monkeypatch.setattr(checkpointd.storage, "entry_points", entry_points)
    assert type(open_store("dictfs://x")) is DictStore
    assert asked == []  # registered in-process: no entry-point lookup
    assert type(open_store("epfs://run")) is DictStore
    assert type(open_store("epfs://again")) is DictStore
    assert asked == ["epfs"]  # loaded once, then registered


def test_register_refuses_the_local_protocol() -> None:
    with pytest.raises(StorageError):
        register_store("file", DictStore)


def test_generic_fsspec_translates_its_own_errors_and_lets_bugs_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = open_store("memory://translate")
    assert isinstance(store, FsspecStore)

    def blocksize(*args: object, **kwargs: object) -> bytes:
        raise BlocksizeMismatchError("block size changed")

    monkeypatch.setattr(store.fs, "cat_file", blocksize)
    with pytest.raises(StorageError, match="BlocksizeMismatchError"):
        store.read_bytes("x", 0, 1)

    def bug(*args: object, **kwargs: object) -> bytes:
        raise KeyError("a bug, not a storage error")

    monkeypatch.setattr(store.fs, "cat_file", bug)
    with pytest.raises(KeyError):
        store.read_bytes("x", 0, 1)
