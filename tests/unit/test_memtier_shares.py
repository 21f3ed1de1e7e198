"""The memory tier's many-rank shares, without a service: which held files a client may
serve (``recall.servable``), how shares of one step from several local ranks are kept,
found and replaced (``MemoryTier``), and what ``OverlayStore`` reads from where."""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from checkpointd.daemon.client.memstore import MemoryStore
from checkpointd.daemon.client.overlay import MIXED_SOURCE, OverlayStore
from checkpointd.daemon.client.recall import servable
from checkpointd.daemon.server.memtier import HeldCheckpoint, MemoryTier
from checkpointd.daemon.wire.protocol import HeldFile
from checkpointd.daemon.wire.shm import MappedSegment
from checkpointd.errors import StorageError
from checkpointd.format.checksum import crc32c
from checkpointd.format.manifest import FileEntry, Manifest
from checkpointd.storage import open_store


def _manifest(files: list[FileEntry]) -> Manifest:
    return Manifest(
        schema_version=2,
        step=1,
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
        library_version="test",
        files=files,
        components={},
    )


def test_a_held_file_is_servable_only_with_storages_path_size_and_crc32c() -> None:
    data = b"head" + b"x" * 12
    good = HeldFile("a.bin", b"head", 0, 12, crc32c(data))
    manifest = _manifest(
        [
            FileEntry("a.bin", 16, crc32c(data)),
            FileEntry("b.bin", 16, crc32c(data) ^ 1),  # committed again with other bytes
            FileEntry("c.bin", 17, crc32c(data)),  # another size
        ]
    )
    held = [
        good,
        HeldFile("b.bin", b"head", 0, 12, crc32c(data)),
        HeldFile("c.bin", b"head", 0, 12, crc32c(data)),
        HeldFile("d.bin", b"head", 0, 12, crc32c(data)),  # not listed at all
    ]
    assert servable(manifest, held) == [good]


@pytest.fixture
def segments() -> Iterator[list[MappedSegment]]:
    made = [MappedSegment(i, 4096) for i in range(6)]
    yield made
    for segment in made:
        segment.close()


def _held(segment: MappedSegment, step: int, rank: int | None) -> HeldCheckpoint:
    return HeldCheckpoint(step, segment, [], rank=rank)


def test_local_ranks_shares_of_one_step_count_once_and_are_found_by_rank(
    segments: list[MappedSegment],
) -> None:
    released: list[int] = []
    tier = MemoryTier(1, lambda s: released.append(s.ident))
    tier.add("root", _held(segments[0], 1, 0))
    tier.add("root", _held(segments[1], 1, 1))
    assert tier.steps() == {"root": [1]}
    assert released == []
    found = [tier.find("root", 1, rank) for rank in (0, 1, 2)]
    assert [h.segment.ident if h else None for h in found] == [0, 1, 0]  # 2: any share
    assert tier.find("root", 2, 0) is None
    # the same rank's share saved again replaces its copy (freed), not the other's
    tier.add("root", _held(segments[2], 1, 0))
    assert released == [0]
    assert tier.find("root", 1, 0).segment.ident == 2  # type: ignore[union-attr]
    # a newer step: every share of the older one goes (keep=1 step)
    tier.add("root", _held(segments[3], 2, 1))
    assert sorted(released) == [0, 1, 2]
    assert tier.steps() == {"root": [2]}
    # a single process's copy of the step replaces every share of it
    tier.add("root", _held(segments[4], 2, None))
    assert sorted(released) == [0, 1, 2, 3]
    assert tier.find("root", 2, 1).segment.ident == 4  # type: ignore[union-attr]


def test_an_overlay_reads_held_files_from_memory_and_the_rest_from_storage(
    tmp_path: Path,
) -> None:
    folder = "000000000001"
    (tmp_path / folder).mkdir()
    (tmp_path / folder / "held.bin").write_bytes(b"storage copy")
    (tmp_path / folder / "other.bin").write_bytes(b"only on storage")
    mapped = mmap.mmap(-1, 4096)
    mapped[:6] = b"memory"
    storage = open_store(str(tmp_path))
    try:
        held = [HeldFile("held.bin", b"from ", 0, 6, 0)]
        memory = MemoryStore.over(storage.url, folder, b"manifest bytes", held, mapped)
        overlay = OverlayStore(storage, memory)
        assert overlay.read_bytes(f"{folder}/manifest.json") == b"manifest bytes"
        assert overlay.source == "storage"  # the manifest does not count
        assert overlay.read_bytes(f"{folder}/held.bin") == b"from memory"
        assert overlay.source == "memory"
        assert overlay.list_dir(folder) == ["held.bin", "manifest.json", "other.bin"]
        assert overlay.size(f"{folder}/other.bin") == len(b"only on storage")
        pinned = overlay.open_pinned(f"{folder}/other.bin")
        assert pinned is not None
        buffer = bytearray(4)
        pinned.read_into(memoryview(buffer), 5)
        pinned.close()
        assert bytes(buffer) == b"on s"
        assert overlay.source == MIXED_SOURCE == "memory+storage"
        with pytest.raises(StorageError):
            overlay.remove_file(f"{folder}/other.bin")
        overlay.close()  # closes neither store
        assert storage.read_bytes(f"{folder}/other.bin") == b"only on storage"
        del memory, overlay, pinned
    finally:
        storage.close()
    mapped.close()


def test_an_overlay_asks_for_a_further_copy_once_per_file_none_holds(tmp_path: Path) -> None:
    folder = "000000000001"
    (tmp_path / folder).mkdir()
    for name in ("own.bin", "peer.bin", "stored.bin"):
        (tmp_path / folder / name).write_bytes(b"storage copy")
    mapped = mmap.mmap(-1, 4096)
    mapped[:4] = b"mine"
    mapped[4:8] = b"near"
    storage = open_store(str(tmp_path))
    asked: list[str] = []
    try:
        own = MemoryStore.over(
            storage.url, folder, b"m", [HeldFile("own.bin", b"", 0, 4, 0)], mapped
        )
        peer = MemoryStore.over(
            storage.url, folder, b"m", [HeldFile("peer.bin", b"", 4, 4, 0)], mapped
        )

        further = {f"{folder}/peer.bin": (peer, "peer")}

        def more(path: str) -> tuple[MemoryStore, str] | None:
            asked.append(path)
            return further.get(path)

        overlay = OverlayStore(storage, own, "memory", more)
        assert overlay.read_bytes(f"{folder}/own.bin") == b"mine"
        assert asked == []  # the first copy holds it
        assert overlay.source == "memory"
        assert overlay.size(f"{folder}/peer.bin") == 4
        assert overlay.read_bytes(f"{folder}/peer.bin") == b"near"
        assert overlay.source == "memory+peer"
        assert overlay.read_bytes(f"{folder}/stored.bin") == b"storage copy"
        assert overlay.read_bytes(f"{folder}/stored.bin") == b"storage copy"
        assert asked == [f"{folder}/peer.bin", f"{folder}/stored.bin"]  # once each
        assert overlay.source == "memory+peer+storage"
        further.clear()
        del own, peer, overlay
    finally:
        storage.close()
    mapped.close()
