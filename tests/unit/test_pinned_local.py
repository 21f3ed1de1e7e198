"""A pinned local file (``LocalStore.open_pinned``) tells a write into it from its deletion
or renaming: restore lands bytes checked once only from a file still ``unchanged``."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from checkpointd.storage import LocalStore
from checkpointd.storage.base import PinnedFile


@pytest.fixture
def pinned(tmp_path: Path) -> Iterator[tuple[Path, PinnedFile]]:
    store = LocalStore(str(tmp_path))
    (tmp_path / "a").write_bytes(b"0123456789" * 100)
    found = store.open_pinned("a")
    try:
        yield tmp_path / "a", found
    finally:
        found.close()


def _write(path: Path) -> None:
    with path.open("r+b") as f:
        f.seek(500)
        f.write(b"X")


def _append(path: Path) -> None:
    with path.open("ab") as f:
        f.write(b"more")


def _truncate(path: Path) -> None:
    os.truncate(path, 10)


def _write_through_a_map(path: Path) -> None:
    with path.open("r+b") as f, mmap.mmap(f.fileno(), 0) as mapped:
        mapped[7] = ord("Y")
        mapped.flush()


@pytest.mark.parametrize("change", [_write, _append, _truncate, _write_through_a_map])
def test_a_write_into_the_file_is_seen(
    pinned: tuple[Path, PinnedFile], change: Callable[[Path], None]
) -> None:
    path, file = pinned
    assert file.unchanged()
    change(path)
    assert not file.unchanged()


def test_renaming_deleting_and_reading_are_not_changes(pinned: tuple[Path, PinnedFile]) -> None:
    path, file = pinned
    os.chmod(path, 0o600)
    path.rename(path.with_name("b"))
    path.with_name("b").unlink()
    path.write_bytes(b"a new file under the old name")
    buffer = memoryview(bytearray(10))
    file.read_into(buffer, 990)
    assert bytes(buffer) == b"0123456789"
    assert file.unchanged()
