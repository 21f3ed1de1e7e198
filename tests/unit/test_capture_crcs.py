"""Capture checksums each plain CPU tensor as it lands in the arena (bytecopy's checked
copy, while the bytes are in cache), and the writer combines those CRC32Cs instead of
reading the bytes from memory a second time: the files' manifest CRC32Cs are the
bytes', in-process and through the service's description of a snapshot; a CRC32C the
capture did not take is computed by the writer as before; and a wrong one makes a file
the reader refuses, never one read wrong."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import anyio
import crc32c as reference
import pytest
import torch

import checkpointd
from checkpointd import tunables
from checkpointd.daemon.wire import protocol as p
from checkpointd.daemon.wire.snapshot import describe, rebuild
from checkpointd.format.checksum import crc32c_combine
from checkpointd.memory import bytecopy
from checkpointd.read.catalog import read_manifest
from checkpointd.read.verify import verify_step
from checkpointd.storage import LocalStore
from checkpointd.write.capture import CapturedComponent, StagingBuffer, capture
from checkpointd.write.commit import publish_plan
from checkpointd.write.items import RankFile, WriteFile, file_crc32c
from checkpointd.write.plan import SavePlan, Snapshot, plan_snapshot


def _state() -> dict[str, dict[str, object]]:
    generator = torch.Generator().manual_seed(5)
    return {
        "model": {
            "w": torch.randn(3001, generator=generator),
            "h": torch.randn(77, generator=generator).to(torch.bfloat16),
            "i": torch.randint(0, 1 << 40, (513,), generator=generator),
            "empty": torch.zeros(0),
            "t": torch.randn(40, 30, generator=generator).t(),  # not contiguous: torch copies it
            "lr": 0.5,
        },
        "tree": {"epoch": 3},
    }


def _region(component: CapturedComponent, buffer: StagingBuffer, at: int) -> bytes:
    entry = component.entries[at]
    return bytes(buffer.view(component.offset + entry.begin, entry.end - entry.begin))


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks and checked pieces far smaller than the tensors, on three threads."""
    monkeypatch.setattr(tunables, "COPY_CHUNK_BYTES", 4096)
    monkeypatch.setattr(tunables, "COPY_CHECKED_BYTES", 1000)
    monkeypatch.setattr(tunables, "COPY_PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(tunables, "CAPTURE_CRC_MIN_BYTES", 0)
    monkeypatch.setattr(bytecopy, "_threads", lambda: 3)


@pytest.mark.usefixtures("small_chunks")
def test_capture_takes_each_plain_tensors_crc32c_as_it_lands() -> None:
    buffer = StagingBuffer()
    model, tree = capture(_state(), buffer)
    assert tree.crcs == []  # no tensors
    names = [entry.name for entry in model.entries]
    assert len(model.crcs) == len(names) == 5
    for at, name in enumerate(names):
        landed = _region(model, buffer, at)
        if name == "t":
            assert model.crcs[at] is None  # copied by torch: the writer checksums it
        else:
            assert model.crcs[at] == reference.crc32c(landed), name
    assert model.crcs[names.index("empty")] == 0


@pytest.mark.usefixtures("small_chunks")
def test_the_tensor_file_gets_the_combined_crc32c_and_the_header_none() -> None:
    buffer = StagingBuffer()
    state = _state()
    del state["model"]["t"]
    snapshot = Snapshot(1, capture(state, buffer), buffer, datetime.now(UTC), {}, {})
    (tensors,) = [f for f in plan_snapshot(snapshot, "tok").files if f.name.endswith("tensors")]
    assert isinstance(tensors, WriteFile)
    header, data = tensors.crcs
    assert header is None
    assert data == reference.crc32c(bytes(tensors.parts[1]))
    # one tensor whose CRC32C capture did not take: the plan reads only its bytes
    buffer = StagingBuffer()
    snapshot = Snapshot(1, capture(_state(), buffer), buffer, datetime.now(UTC), {}, {})
    (tensors,) = [f for f in plan_snapshot(snapshot, "tok").files if f.name.endswith("tensors")]
    assert isinstance(tensors, WriteFile)
    assert list(tensors.crcs) == [None, reference.crc32c(bytes(tensors.parts[1]))]


def test_tensors_below_the_minimum_are_checksummed_by_the_plan_not_by_capture(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Capture checksums only tensors of CAPTURE_CRC_MIN_BYTES or more (per tensor, its
    checked copy costs more than a read); the file's CRC32C is whole either way."""
    monkeypatch.setattr(tunables, "CAPTURE_CRC_MIN_BYTES", 4096)
    state = {
        "model": {"big": torch.randn(64, 64), "bias": torch.randn(64), "w": torch.randn(32, 32)}
    }
    buffer = StagingBuffer()
    (model,) = capture(state, buffer)
    taken = {e.name: crc for e, crc in zip(model.entries, model.crcs, strict=True)}
    assert taken["bias"] is None
    assert taken["big"] == reference.crc32c(state["model"]["big"].numpy().tobytes())
    assert taken["w"] == reference.crc32c(state["model"]["w"].numpy().tobytes())
    snapshot = Snapshot(1, [model], buffer, datetime.now(UTC), {}, {})
    (tensors,) = [f for f in plan_snapshot(snapshot, "tok").files if f.name.endswith("tensors")]
    assert isinstance(tensors, WriteFile)
    assert list(tensors.crcs) == [None, reference.crc32c(bytes(tensors.parts[1]))]


def test_saved_files_carry_the_crc32c_of_their_bytes(tmp_path: Path) -> None:
    """Blocking staging (CRC32Cs from capture) and overlapped (from the writer) both
    commit checkpoints that verify and load bit-exact."""
    state = _state()
    for staging in ("blocking", "overlapped"):
        root = str(tmp_path / staging)
        with checkpointd.CheckpointWriter(root, staging=staging) as writer:  # type: ignore[arg-type]
            writer.save(1, state).result(60)
        store = LocalStore(root)
        assert verify_step(store, 1, read_manifest(store, 1)) == []
        loaded = checkpointd.load(root).state["model"]
        for name in ("w", "h", "i", "t"):
            assert torch.equal(loaded[name], state["model"][name])  # type: ignore[arg-type]


def _commit(root: Path, file: WriteFile) -> None:
    store = LocalStore(str(root))
    plan = SavePlan(1, [file], {}, datetime.now(UTC), {}, {})

    async def run() -> None:
        await publish_plan(store, plan, anyio.CapacityLimiter(2), chunk_bytes=3)

    anyio.run(run)


def test_the_writer_combines_a_known_crc32c_instead_of_reading_the_part(
    tmp_path: Path,
) -> None:
    head, data = b"header", b"tensor bytes"
    _commit(
        tmp_path / "right",
        WriteFile("f.bin", [head, data], "", crcs=[None, reference.crc32c(data)]),
    )
    store = LocalStore(str(tmp_path / "right"))
    (entry,) = read_manifest(store, 1).files
    assert entry.crc32c == reference.crc32c(head + data)
    assert verify_step(store, 1, read_manifest(store, 1)) == []
    # a CRC32C that is not its part's is taken as given: the reader refuses the file
    wrong = reference.crc32c(data) ^ 1
    _commit(tmp_path / "wrong", WriteFile("f.bin", [head, data], "", crcs=[None, wrong]))
    store = LocalStore(str(tmp_path / "wrong"))
    (entry,) = read_manifest(store, 1).files
    assert entry.crc32c == crc32c_combine(reference.crc32c(head), wrong, len(data))
    (problem,) = verify_step(store, 1, read_manifest(store, 1))
    assert "f.bin" in problem


def test_a_files_crc32c_reads_only_the_parts_capture_did_not_checksum() -> None:
    """What a many-rank service's memory tier digests of a file another rank wrote."""
    head, data = b"header", b"tensor bytes"
    assert file_crc32c(RankFile("f", [head, data], "m", 1)) == reference.crc32c(head + data)
    known = WriteFile("f", [head, data], "m", crcs=[None, reference.crc32c(data)])
    assert file_crc32c(known) == reference.crc32c(head + data)
    wrong = WriteFile("f", [head, data], "m", crcs=[None, 7])  # taken as given
    assert file_crc32c(wrong) == crc32c_combine(reference.crc32c(head), 7, len(data))


def _over_the_wire(desc: p.SnapshotDesc) -> p.SnapshotDesc:
    message = p.decode(p.encode(p.Submit(1, writer=1, segment=1, snapshot=desc))[4:])
    assert isinstance(message, p.Submit)
    return message.snapshot


@pytest.mark.usefixtures("small_chunks")
def test_the_service_plans_with_the_crc32cs_the_trainer_took() -> None:
    buffer = StagingBuffer()
    snapshot = Snapshot(3, capture(_state(), buffer), buffer, datetime.now(UTC), {}, {})
    arena = torch.frombuffer(bytearray(buffer.view(0, buffer.capacity)), dtype=torch.uint8)
    desc = _over_the_wire(describe(snapshot))
    rebuilt = rebuild(desc, arena, snapshot.layout)
    assert [c.crcs for c in rebuilt.components] == [c.crcs for c in snapshot.components]
    original, again = plan_snapshot(snapshot, "tok"), plan_snapshot(rebuilt, "tok")
    assert [getattr(f, "crcs", None) for f in again.files] == [
        getattr(f, "crcs", None) for f in original.files
    ]


@pytest.mark.parametrize(
    ("crcs", "message"), [([1], "1 CRC32Cs for 5 tensors"), ([0, 0, 0, 0, 1 << 32], "out of range")]
)
def test_the_service_refuses_crc32cs_that_do_not_fit_the_tensors(
    crcs: list[int | None], message: str
) -> None:
    buffer = StagingBuffer()
    snapshot = Snapshot(3, capture(_state(), buffer), buffer, datetime.now(UTC), {}, {})
    arena = torch.frombuffer(bytearray(buffer.view(0, buffer.capacity)), dtype=torch.uint8)
    desc = describe(snapshot)
    model = desc.components[0]
    fields = {name: getattr(model, name) for name in model.__struct_fields__}
    forged = p.ComponentDesc(**(fields | {"crcs": crcs}))
    bad = p.SnapshotDesc(
        desc.step, desc.created_at, [forged, *desc.components[1:]], desc.metrics, desc.metadata
    )
    with pytest.raises(p.ProtocolError, match=message):
        rebuild(_over_the_wire(bad), arena, snapshot.layout)
