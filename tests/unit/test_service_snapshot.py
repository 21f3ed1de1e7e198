"""A snapshot with DTensor shards, described by the trainer and rebuilt by the service
(daemon/wire/snapshot.py) with the layout its writer sent in ``OpenWriter``: the rebuilt
snapshot plans the very files the original does, and a description whose shards do
not fit the segment or the tensor is a ProtocolError."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest
import torch

from checkpointd import tunables
from checkpointd.daemon.wire import protocol as p
from checkpointd.daemon.wire.snapshot import describe, rebuild
from checkpointd.errors import InvalidArgumentError
from checkpointd.format.codec import TensorRef
from checkpointd.format.header import TensorEntry
from checkpointd.format.layout import DIRECT_ALIGN, SaveLayout
from checkpointd.write.capture import CapturedComponent, CapturedShard, StagingBuffer
from checkpointd.write.plan import Snapshot, plan_snapshot
from checkpointd.write.ranked_merge import indexed


def _snapshot() -> tuple[Snapshot, torch.Tensor]:
    """Rank 1's snapshot of a component with a plain tensor and two DTensors: rows 3..5
    of a (6, 4) float32 it writes, and a bfloat16 it holds no part of."""
    arena = torch.zeros(256, dtype=torch.uint8)
    generator = torch.Generator().manual_seed(3)
    arena[:] = torch.randint(0, 256, (256,), dtype=torch.uint8, generator=generator)
    component = CapturedComponent(
        "model",
        {"b": TensorRef("b"), "p": TensorRef("p"), "q": TensorRef("q"), "lr": 0.5},
        [TensorEntry("b", torch.float32, (2,), 0, 8)],
        0,
        8,
        [
            CapturedShard("p", torch.float32, (6, 4), (3, 0), (3, 4), True),
            CapturedShard("q", torch.bfloat16, (5,), (5,), (0,), False),
        ],
        [TensorEntry("p", torch.float32, (3, 4), 0, 48)],
        64,
        48,
    )
    created = datetime(2026, 1, 2, tzinfo=UTC)
    snapshot = Snapshot(1, [component], StagingBuffer.over(arena), created, {}, {}, rank=1)
    return snapshot, arena


def _over_the_wire(desc: p.SnapshotDesc) -> p.SnapshotDesc:
    message = p.decode(p.encode(p.Submit(1, writer=1, segment=1, snapshot=desc))[4:])
    assert isinstance(message, p.Submit)
    return message.snapshot


def _opened(layout: SaveLayout) -> SaveLayout:
    """``layout`` as the service reads it from the trainer's ``OpenWriter``."""
    message = p.decode(p.encode(p.OpenWriter(1, root="/r", layout=layout))[4:])
    assert isinstance(message, p.OpenWriter)
    assert message.layout is not None
    return message.layout


def _files(snapshot: Snapshot) -> dict[str, bytes]:
    plan = plan_snapshot(snapshot, "tok", world_size=2)
    return {f.name: b"".join(bytes(part) for part in f.parts) for f in plan.files}


def test_a_rebuilt_sharded_snapshot_plans_the_same_files_and_entries() -> None:
    snapshot, arena = _snapshot()
    rebuilt = rebuild(_over_the_wire(describe(snapshot)), arena, _opened(snapshot.layout))
    (component,) = rebuilt.components
    assert component.shards == snapshot.components[0].shards
    assert component.shard_entries == snapshot.components[0].shard_entries
    original, again = (
        plan_snapshot(snapshot, "tok", world_size=2),
        plan_snapshot(rebuilt, "tok", world_size=2),
    )
    assert original.components == again.components
    assert _files(snapshot) == _files(rebuilt)
    assert "model.tok.rank1.safetensors" in _files(rebuilt)
    assert rebuilt.rank == 1


def test_the_trainers_shard_block_size_travels_with_the_snapshot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tunables, "SHARD_BLOCK_BYTES", 16)
    snapshot, arena = _snapshot()  # made at 16 bytes a block, as its writer was
    monkeypatch.setattr(tunables, "SHARD_BLOCK_BYTES", 8 * 2**20)  # the service's own
    rebuilt = rebuild(_over_the_wire(describe(snapshot)), arena, _opened(snapshot.layout))
    assert rebuilt.layout.shard_block == 16
    entries = plan_snapshot(rebuilt, "tok", world_size=2).components["model"].sharded
    (shard,) = entries["p"].shards
    assert (shard.block_bytes, len(shard.crc32c)) == (16, 3)  # 48 bytes
    assert _files(snapshot) == _files(rebuilt)
    assert plan_snapshot(snapshot, "tok", world_size=2).components == (
        plan_snapshot(rebuilt, "tok", world_size=2).components
    )


def test_the_trainers_direct_io_threshold_travels_with_the_snapshot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tunables, "DIRECT_MIN_BYTES", 1)  # every data region aligned
    snapshot, arena = _snapshot()
    monkeypatch.setattr(tunables, "DIRECT_MIN_BYTES", 2**20)  # the service's own
    rebuilt = rebuild(_over_the_wire(describe(snapshot)), arena, _opened(snapshot.layout))
    assert rebuilt.layout.direct_min == 1
    files = _files(rebuilt)
    assert files == _files(snapshot)
    for name in ("model.tok.safetensors", "model.tok.rank1.safetensors"):  # tensors, shards
        data_start = 8 + int.from_bytes(files[name][:8], "little")
        assert data_start % DIRECT_ALIGN == 0, name  # the trainer's setting, not the service's


def test_the_trainers_shard_index_threshold_travels_with_the_snapshot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tunables, "SHARD_INDEX_MIN_ENTRIES", 0)  # index files at any size
    snapshot, arena = _snapshot()
    monkeypatch.setattr(tunables, "SHARD_INDEX_MIN_ENTRIES", 4096)  # the service's own
    rebuilt = rebuild(_over_the_wire(describe(snapshot)), arena, _opened(snapshot.layout))
    assert rebuilt.layout.shard_index_min == 0
    assert indexed(plan_snapshot(rebuilt, "tok", world_size=2), 2)
    assert not indexed(plan_snapshot(_snapshot()[0], "tok", world_size=2), 2)  # made at 4096


def test_the_trainers_whole_layout_travels_with_the_snapshot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in (("SHARD_BLOCK_BYTES", 16), ("DIRECT_MIN_BYTES", 1)):
        monkeypatch.setattr(tunables, name, value)
    for name, value in (("SHARD_INDEX_MIN_ENTRIES", 0), ("INCREMENTAL_MIN_BYTES", 4)):
        monkeypatch.setattr(tunables, name, value)
    snapshot, arena = _snapshot()
    sent = SaveLayout(16, 1, 0, 4)
    assert snapshot.layout == sent
    for name in ("SHARD_BLOCK_BYTES", "DIRECT_MIN_BYTES", "SHARD_INDEX_MIN_ENTRIES"):
        monkeypatch.setattr(tunables, name, 2**20)  # the service's own
    monkeypatch.setattr(tunables, "INCREMENTAL_MIN_BYTES", 2**20)
    assert rebuild(_over_the_wire(describe(snapshot)), arena, _opened(sent)).layout == sent
    unsent = p.decode(p.encode(p.OpenWriter(1, root="/r"))[4:])  # an older client's
    assert isinstance(unsent, p.OpenWriter)
    assert unsent.layout is None


def test_more_shard_blocks_than_a_manifest_can_list_is_a_protocol_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    snapshot, arena = _snapshot()
    desc = describe(snapshot)
    layout = msgspec.structs.replace(snapshot.layout, shard_block=1)  # 48 blocks
    monkeypatch.setattr(tunables, "MAX_MANIFEST_BYTES", 64)  # room for 32 CRC32Cs at most
    with pytest.raises(p.ProtocolError, match="48 shard blocks"):
        rebuild(_over_the_wire(desc), arena, layout)
    monkeypatch.setattr(tunables, "MAX_MANIFEST_BYTES", 96)
    assert rebuild(_over_the_wire(desc), arena, layout).layout.shard_block == 1


BAD_LAYOUTS = {
    "a shard block of 0 bytes": {"shard_block": 0},
    "a negative shard block": {"shard_block": -8},
    "a negative direct I/O threshold": {"direct_min": -1},
    "a negative shard index threshold": {"shard_index_min": -1},
    "a negative incremental threshold": {"incremental_min": -1},
}


@pytest.mark.parametrize("name", sorted(BAD_LAYOUTS))
def test_a_layout_out_of_range_is_refused(name: str) -> None:
    """What the service checks of an ``OpenWriter``'s layout before it opens the writer."""
    layout = msgspec.structs.replace(SaveLayout.now(), **BAD_LAYOUTS[name])
    with pytest.raises(InvalidArgumentError):
        _opened(layout).check()
    SaveLayout.now().check()


def _component(desc: p.SnapshotDesc, **changes: Any) -> p.SnapshotDesc:
    (component,) = desc.components
    return msgspec.structs.replace(desc, components=[msgspec.structs.replace(component, **changes)])


def _shard(desc: p.SnapshotDesc, index: int, **changes: Any) -> p.SnapshotDesc:
    shards = list(desc.components[0].shards)
    shards[index] = msgspec.structs.replace(shards[index], **changes)
    return _component(desc, shards=shards)


HOSTILE = {
    "shard region past the segment": lambda d: _component(d, shard_offset=240),
    "negative shard region": lambda d: _component(d, shard_nbytes=-8),
    "entry past its region": lambda d: _component(
        d, shard_entries=[p.EntryDesc("p", "F32", [3, 4], 8, 56)]
    ),
    "entry of an unknown shard": lambda d: _component(
        d, shard_entries=[p.EntryDesc("x", "F32", [3, 4], 0, 48)]
    ),
    "written shard without entry": lambda d: _component(d, shard_entries=[]),
    "entry for a shard not written": lambda d: _shard(d, 0, written=False),
    "entry of another shape": lambda d: _shard(d, 0, local_shape=[4, 3]),
    "entry of another dtype": lambda d: _shard(d, 0, dtype="I32"),
    "shard outside its tensor": lambda d: _shard(d, 0, offsets=[4, 0]),
    "negative offset": lambda d: _shard(d, 1, offsets=[-1]),
    "fewer offsets than dimensions": lambda d: _shard(d, 0, offsets=[3]),
    "unknown dtype": lambda d: _shard(d, 1, dtype="F128"),
    "a shard twice": lambda d: _component(d, shards=[d.components[0].shards[0]] * 2),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_shard_description_that_does_not_fit_is_a_protocol_error(name: str) -> None:
    snapshot, arena = _snapshot()
    desc = HOSTILE[name](describe(snapshot))
    with pytest.raises(p.ProtocolError):
        rebuild(_over_the_wire(desc), arena, snapshot.layout)
