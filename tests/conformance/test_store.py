"""One suite every storage backend passes: memory://, local disk, S3 over HTTP
(moto, and s3rver: an S3 server without If-None-Match), dictfs:// (the
one-module example backend in tests/support/dict_store.py), GCS (fake-gcs-server,
which honours ifGenerationMatch=0, and gcp-storage-emulator, which ignores it)
and Azure Blob (Azurite, which honours If-None-Match: *).

Capability differences are declared by the store (Store.capabilities) and
checked here: on s3rver the manifest publish is guarded but not exclusive (it
warns), and incomplete multipart uploads can neither be listed nor aborted there
(tests/integration/test_s3rver.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from checkpointd.errors import (
    CheckpointExistsError,
    StorageCapabilityWarning,
    StorageError,
    StorageNotFoundError,
)
from checkpointd.storage import Store, open_store
from tests.conftest import Root

BACKENDS = ["memory", "local", "s3", "s3rver", "dictfs", "gcs", "gcsemu", "azure"]
EXCLUSIVE = {
    "memory": False,
    "local": True,
    "s3": True,
    "s3rver": False,
    "dictfs": True,
    "gcs": True,
    "gcsemu": False,
    "azure": True,
}
PROBED = {"s3", "s3rver", "gcs", "gcsemu", "azure"}
"""Backends whose exclusive create depends on the server: asked once, on first publish."""


@pytest.fixture(params=BACKENDS)
def root(request: pytest.FixtureRequest) -> Root:
    """Each test runs once per backend, s3rver included."""
    found: Root = request.getfixturevalue(f"{request.param}_root")
    return found


@pytest.fixture
def store(root: Root) -> Store:
    store = open_store(root.url, root.storage_options)
    store.make_dir("d")
    return store


def _publishing(store: Store) -> contextlib.AbstractContextManager[object]:
    """Expect the once-per-store warning where publish cannot be exclusive."""
    if store.exclusive_create:
        return contextlib.nullcontext()
    return pytest.warns(StorageCapabilityWarning, match="not exclusive")


def _write(store: Store, path: str, *parts: bytes) -> None:
    sink = store.open_file(path)
    for part in parts:
        sink.write(part)
    sink.commit()


def test_committed_file_reads_back(store: Store) -> None:
    _write(store, "d/a.bin", b"hello ", b"world")
    assert store.size("d/a.bin") == 11
    assert store.read_bytes("d/a.bin") == b"hello world"
    assert store.read_bytes("d/a.bin", 6, 5) == b"world"
    assert store.exists("d/a.bin")


def test_large_file_in_many_writes(store: Store) -> None:
    chunk = bytes(range(256)) * 4096  # 1 MiB
    _write(store, "d/big.bin", *([chunk] * 12))
    assert store.size("d/big.bin") == 12 * len(chunk)
    buffer = bytearray(len(chunk))
    store.read_into("d/big.bin", memoryview(buffer), 7 * len(chunk))
    assert buffer == chunk


def test_commit_replaces_an_existing_file(store: Store) -> None:
    _write(store, "d/a.bin", b"old")
    _write(store, "d/a.bin", b"new!")
    assert store.read_bytes("d/a.bin") == b"new!"


def test_discard_leaves_no_trace(store: Store) -> None:
    sink = store.open_file("d/gone.bin")
    sink.write(b"x" * 1000)
    sink.discard()
    assert not store.exists("d/gone.bin")
    assert store.list_dir("d") == []


def test_uncommitted_file_is_invisible_where_the_store_defers(store: Store, root: Root) -> None:
    if root.kind == "memory":
        pytest.skip("memory:// shows keys while they are written; only the manifest commits")
    sink = store.open_file("d/pending.bin")
    sink.write(b"y" * (6 * 2**20))
    assert not store.exists("d/pending.bin")
    assert "pending.bin" not in store.list_dir("d")
    sink.commit()
    assert store.exists("d/pending.bin")


def test_publish_is_exclusive(store: Store) -> None:
    with _publishing(store):
        store.publish("d/manifest.json", b"first")
    with pytest.raises(CheckpointExistsError):
        store.publish("d/manifest.json", b"second")
    assert store.read_bytes("d/manifest.json") == b"first"


def test_declared_exclusive_create(store: Store, root: Root) -> None:
    _write(store, "d/a", b"1")
    # Reading the declaration never touches the storage: S3, GCS, Azure say "not known yet".
    declared = store.capabilities.exclusive_create
    assert declared is (None if root.kind in PROBED else EXCLUSIVE[root.kind])
    assert store.exclusive_create is EXCLUSIVE[root.kind]
    assert store.capabilities.exclusive_create in (None, EXCLUSIVE[root.kind])
    assert store.list_dir("") == ["d"], "the capability probe left its key behind"


@pytest.fixture
def other(root: Root, store: Store) -> Iterator[Store]:
    """A second client of the same root (its own connection and caches)."""
    second = open_store(root.url, root.storage_options)
    yield second
    second.close()


def test_sees_a_file_another_client_created_after_listing(store: Store, other: Store) -> None:
    _write(store, "d/old", b"1")
    assert store.list_dir("d") == ["old"]
    assert not store.exists("d/new")
    _write(other, "d/new", b"22")
    assert store.exists("d/new")
    assert store.size("d/new") == 2
    modified = store.modified("d/new")
    assert modified is None or modified > 0
    other.remove_file("d/old")
    assert not store.exists("d/old")
    with pytest.raises(StorageNotFoundError):
        store.size("d/old")
    assert store.list_dir("d") == ["new"]


def test_list_dir_shows_direct_children_sorted(store: Store) -> None:
    _write(store, "d/b", b"1")
    _write(store, "d/a", b"2")
    store.make_dir("d/sub")
    _write(store, "d/sub/c", b"3")
    assert store.list_dir("d") == ["a", "b", "sub"]
    assert store.list_dir("d/sub") == ["c"]
    assert store.list_dir("nothing-here") == []
    assert "d" in store.list_dir("")


def test_missing_files_raise_not_found(store: Store) -> None:
    with pytest.raises(StorageNotFoundError):
        store.size("d/missing")
    with pytest.raises(StorageNotFoundError):
        store.read_bytes("d/missing")
    assert not store.exists("d/missing")


def test_short_read_is_an_error(store: Store) -> None:
    _write(store, "d/short", b"abc")
    with pytest.raises(StorageError):
        store.read_into("d/short", memoryview(bytearray(10)))


def test_a_sized_read_tells_the_size_and_fills_only_what_the_file_holds(store: Store) -> None:
    _write(store, "d/sized", b"0123456789")
    buffer = bytearray(4)
    assert store.read_into_sized("d/sized", memoryview(buffer), 3) == 10
    assert bytes(buffer) == b"3456"
    untouched = bytearray(b"x" * 8)
    assert store.read_into_sized("d/sized", memoryview(untouched), 5) == 10  # past the end
    assert untouched == b"x" * 8
    assert store.read_into_sized("d/sized", memoryview(bytearray(0)), 0) == 10
    with pytest.raises(StorageNotFoundError):
        store.read_into_sized("d/missing", memoryview(bytearray(4)))


def test_remove_file_and_dir_are_idempotent(store: Store) -> None:
    _write(store, "d/x", b"1")
    _write(store, "d/y", b"2")
    store.remove_file("d/x")
    store.remove_file("d/x")
    assert store.list_dir("d") == ["y"]
    store.remove_dir("d")
    store.remove_dir("d")
    assert store.list_dir("d") == []
    assert not store.exists("d/y")


@pytest.mark.parametrize("path", ["../escape", "/abs", "d/../../x", "d//x", "./d", "d\\x"])
def test_paths_outside_the_root_are_refused(store: Store, path: str) -> None:
    with pytest.raises(StorageError, match="refusing path"):
        store.open_file(path)
    with pytest.raises(StorageError, match="refusing path"):
        store.size(path)


def test_declared_modification_times_hold(store: Store) -> None:
    _write(store, "d/a", b"1")
    modified = store.modified("d/a")
    if store.capabilities.modification_times:
        assert isinstance(modified, float)
        assert modified > 0
    else:
        assert modified is None


def test_declared_folders_are_dated(store: Store) -> None:
    _write(store, "d/a", b"1")
    if not store.capabilities.folders:
        pytest.skip("folders are implicit prefixes here: nothing to date")
    modified = store.modified("d")
    assert isinstance(modified, float)
    assert modified > 0


def test_map_file_only_where_declared(store: Store) -> None:
    _write(store, "d/a", b"mapped bytes")
    if store.capabilities.memory_map:
        with store.map_file("d/a") as mapped:
            assert mapped[:] == b"mapped bytes"
    else:
        with pytest.raises(StorageError, match="cannot map"):
            store.map_file("d/a")


def test_a_pinned_file_outlives_its_deletion_unchanged(store: Store) -> None:
    _write(store, "d/a", b"pinned bytes")
    pinned = store.open_pinned("d/a")
    if pinned is None:
        pytest.skip("this store cannot pin a file (restore reads it whole instead)")
    try:
        store.remove_file("d/a")
        _write(store, "d/a", b"other bytes!")  # a new file under the old name
        buffer = memoryview(bytearray(12))
        pinned.read_into(buffer)
        assert bytes(buffer) == b"pinned bytes"
        assert pinned.unchanged()  # deleting it is not a write into it
    finally:
        pinned.close()


def test_pending_uploads_only_where_declared(store: Store, root: Root) -> None:
    if not store.capabilities.pending_uploads:
        assert store.pending_uploads() == []
        return
    if root.kind == "s3rver":
        pytest.skip("s3rver can neither list nor abort multipart uploads (test_s3rver.py)")
    sink = store.open_file("d/big")
    sink.write(b"z" * (17 * 2**20))  # more than one part: a multipart upload is under way
    try:
        assert [u.path for u in store.pending_uploads()] == ["d/big"]
    finally:
        sink.discard()
    assert store.pending_uploads() == []


def test_guarded_publish_never_takes_a_racing_writers_file(
    store: Store, other: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where publish cannot be exclusive, a write overwritten by another writer between
    our write and our read-back raises instead of reporting success."""
    if store.exclusive_create:
        pytest.skip("publish is an atomic create-if-absent here")
    real_write = store._write_whole  # noqa: SLF001 - fault: a race between the store's own write and read-back

    def write_then_raced(path: str, data: bytes) -> None:
        real_write(path, data)
        _write(other, path, b"theirs")

    monkeypatch.setattr(store, "_write_whole", write_then_raced)
    with _publishing(store), pytest.raises(CheckpointExistsError, match="another writer"):
        store.publish("d/manifest.json", b"ours")
    assert other.read_bytes("d/manifest.json") == b"theirs"


def test_shared_folders_beside_step_folders(store: Store) -> None:
    """What incremental saves need of a backend (maintain/blobs.py): folders that are not step
    folders, made twice, listed when absent, files replaced and removed there."""
    assert store.list_dir("pins") == []  # never made: empty, not an error
    store.make_dir("blobs")
    store.make_dir("blobs")  # a second writer makes it again
    name = "xxh128-" + "ab" * 16
    _write(store, f"blobs/{name}", b"tensor bytes")
    _write(store, f"blobs/{name}", b"tensor bytes")  # same name, same bytes: a rewrite
    assert store.list_dir("blobs") == [name]
    assert store.size(f"blobs/{name}") == 12
    store.remove_file(f"blobs/{name}")
    assert store.list_dir("blobs") == []
    store.remove_file(f"blobs/{name}")  # already gone: nothing to do
