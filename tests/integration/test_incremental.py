"""Incremental checkpoints (``incremental=True``) on memory://, local disk and S3 (moto).

Unchanged large tensors are written once as shared blobs and referenced after;
every checkpoint still loads whole; retention and gc delete a blob only when no
committed manifest (and no pin of a save in flight) uses it; damage to a shared
blob is damage to every checkpoint that uses it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import torch

import checkpointd
from checkpointd import tunables
from checkpointd.errors import CorruptCheckpointError, InvalidArgumentError
from checkpointd.format.layout import BLOBS_DIR, PINS_DIR, blob_path, is_blob_name
from checkpointd.maintain.blobs import write_pin
from checkpointd.maintain.gc import apply_gc, plan_gc
from checkpointd.maintain.retention import RetentionPolicy, delete_checkpoints
from checkpointd.read import catalog
from checkpointd.read.verify import verify_step
from checkpointd.storage import Store, open_store
from checkpointd.write.incremental import IncrementalSaver
from tests.conftest import Root
from tests.faults.helpers import same
from tests.support.gates import hold_local_writes

SMALL = 1024
"""INCREMENTAL_MIN_BYTES in these tests: a (32, 32) float32 tensor (4 KiB) is a blob."""


@pytest.fixture(autouse=True)
def _small_blobs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tunables, "INCREMENTAL_MIN_BYTES", SMALL)


def lora_state(step: int, base: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A frozen base (shared across saves), an adapter and its optimizer state that
    change every save, and a tiny tensor that stays in the step's own file."""
    gen = torch.Generator().manual_seed(step)
    return {
        "model": {**base, "lora_a": torch.randn(32, 32, generator=gen)},
        "optimizer": {"exp_avg": torch.randn(32, 32, generator=gen), "step": torch.tensor(step)},
        "meta": {"step": step},
    }


def frozen_base() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return {f"layer{i}.weight": torch.randn(64, 64, generator=gen) for i in range(4)}


@pytest.fixture
def store(any_root: Root) -> Iterator[Store]:
    opened = open_store(any_root.url, any_root.storage_options)
    try:
        yield opened
    finally:
        opened.close()


def _save(root: Root, steps: range, base: dict[str, torch.Tensor], **options: Any) -> list[Any]:
    infos = []
    with checkpointd.CheckpointWriter(
        root.url, storage_options=root.storage_options, incremental=True, **options
    ) as writer:
        for step in steps:
            infos.append(writer.save(step, lora_state(step, base)).result())
    return infos


def _blobs(store: Store) -> set[str]:
    return {n for n in store.list_dir(BLOBS_DIR) if is_blob_name(n)}


def _stored_bytes(store: Store) -> int:
    """Bytes of every file in step folders and in the blob folder (manifests excluded)."""
    total = 0
    for folder in store.list_dir(""):
        if folder == BLOBS_DIR or folder.isdigit():
            names = [n for n in store.list_dir(folder) if n != "manifest.json"]
            total += sum(store.size(f"{folder}/{n}") for n in names)
    return total


def _used(store: Store) -> set[str]:
    return {b.name for _, m in catalog.committed(store) for b in m.blobs}


def test_unchanged_tensors_are_written_once_and_every_step_loads_whole(
    any_root: Root, store: Store
) -> None:
    base = frozen_base()
    infos = _save(any_root, range(1, 5), base)
    base_bytes = sum(t.numel() * 4 for t in base.values())
    assert infos[0].referenced_nbytes == 0
    for info in infos[1:]:
        # Only the adapter and its optimizer state (two 4 KiB blobs) and the small files.
        assert info.referenced_nbytes == base_bytes
        assert info.written_nbytes < infos[0].written_nbytes - base_bytes + 1
        assert info.nbytes == infos[0].nbytes
    assert len(_blobs(store)) == len(base) + 2 * 4
    for step in range(1, 5):
        loaded = checkpointd.load(any_root.url, step, storage_options=any_root.storage_options)
        assert same(loaded.state, lora_state(step, base))
        manifest = catalog.read_manifest(store, step)
        assert manifest.schema_version == 2
        assert verify_step(store, step, manifest) == []
    assert store.list_dir(PINS_DIR) == []  # each save dropped its pin


def test_keep_last_2_keeps_exactly_the_blobs_its_checkpoints_use(
    any_root: Root, store: Store
) -> None:
    base = frozen_base()
    _save(any_root, range(1, 7), base, keep_last=2)
    assert [s for s, _ in catalog.committed(store)] == [5, 6]
    assert _blobs(store) == _used(store)
    assert len(_blobs(store)) == len(base) + 2 * 2
    for step in (5, 6):
        loaded = checkpointd.load(any_root.url, step, storage_options=any_root.storage_options)
        assert same(loaded.state, lora_state(step, base))


def test_damaged_shared_blob_is_reported_for_every_checkpoint_using_it(
    any_root: Root, store: Store
) -> None:
    base = frozen_base()
    _save(any_root, range(1, 4), base)
    manifest = catalog.read_manifest(store, 3)
    ref = manifest.components["model"].refs["layer0.weight"]
    size = next(b.size for b in manifest.blobs if b.name == ref.blob)
    sink = store.open_file(blob_path(ref.blob))
    sink.write(b"\x00" * size)  # same size, other bytes
    sink.commit()
    seen: dict[tuple[str, int], str | None] = {}
    for step in (1, 2, 3):
        bad = verify_step(store, step, catalog.read_manifest(store, step), seen=seen)
        assert len(bad) == 1
        assert ref.blob in bad[0]
        assert "hash to" in bad[0]
        with pytest.raises(CorruptCheckpointError, match=ref.blob):
            checkpointd.load(any_root.url, step, storage_options=any_root.storage_options)
    assert len(seen) == len(_blobs(store))  # each blob read once, shared ones too


def test_a_missing_referenced_blob_is_written_again_by_the_next_save(
    any_root: Root, store: Store
) -> None:
    base = frozen_base()
    _save(any_root, range(1, 2), base)
    manifest = catalog.read_manifest(store, 1)
    lost = manifest.components["model"].refs["layer1.weight"].blob
    store.remove_file(blob_path(lost))
    # A new writer references step 1's blobs; it finds one gone and writes it back.
    infos = _save(any_root, range(2, 3), base)
    assert lost in store.list_dir(BLOBS_DIR)
    assert infos[0].referenced_nbytes > 0
    for step in (1, 2):
        loaded = checkpointd.load(any_root.url, step, storage_options=any_root.storage_options)
        assert same(loaded.state, lora_state(step, base))


def test_deleting_an_old_step_keeps_blobs_a_newer_one_or_a_pin_uses(
    any_root: Root, store: Store
) -> None:
    base = frozen_base()
    _save(any_root, range(1, 3), base)
    only_1 = {b.name for b in catalog.read_manifest(store, 1).blobs} - {
        b.name for b in catalog.read_manifest(store, 2).blobs
    }
    assert len(only_1) == 2  # step 1's adapter and optimizer state
    pinned = sorted(only_1)[0]
    pin = write_pin(store, 3, "feedbeef", [pinned])  # a save in flight may reference it
    assert delete_checkpoints(store, [1]) == [1]
    assert _blobs(store) == _used(store) | {pinned}
    loaded = checkpointd.load(any_root.url, 2, storage_options=any_root.storage_options)
    assert same(loaded.state, lora_state(2, base))
    # The pin's save died: gc removes the pin and then the blob, once they are old.
    policy = RetentionPolicy()
    plan = plan_gc(store, policy, older_than=0.0)
    assert {x.kind for x in plan.leftovers} >= {"pin"}
    apply_gc(store, plan)
    assert pin.rsplit("/", 1)[1] not in store.list_dir(PINS_DIR)
    apply_gc(store, plan_gc(store, policy, older_than=0.0))
    assert _blobs(store) == _used(store)


def test_gc_removes_orphan_blobs_but_never_one_a_manifest_uses(
    any_root: Root, store: Store
) -> None:
    base = frozen_base()
    _save(any_root, range(1, 4), base)
    orphan = "xxh128-" + "0" * 32
    sink = store.open_file(blob_path(orphan))
    sink.write(b"left by a crashed save")
    sink.commit()
    plan = plan_gc(store, RetentionPolicy(keep_last=1), older_than=0.0)
    assert [x.path for x in plan.leftovers if x.kind == "blob"] == [blob_path(orphan)]
    before = _stored_bytes(store)
    apply_gc(store, plan)
    assert before - _stored_bytes(store) == plan.freed  # shared blobs steps 3 uses not counted
    assert [s for s, _ in catalog.committed(store)] == [3]
    assert _blobs(store) == _used(store)
    loaded = checkpointd.load(any_root.url, storage_options=any_root.storage_options)
    assert same(loaded.state, lora_state(3, base))


def test_same_bytes_twice_in_one_save_are_one_blob(local_root: Root) -> None:
    zeros = {"b1": torch.zeros(32, 32), "b2": torch.zeros(32, 32), "b3": torch.zeros(1024)}
    with checkpointd.CheckpointWriter(local_root.url, incremental=True) as writer:
        info = writer.save(1, {"lora": zeros}).result()
    manifest = catalog.read_manifest(open_store(local_root.url), 1)
    assert len(manifest.blobs) == 1  # (32, 32) and (1024,) float32 zeros: the same bytes
    assert info.nbytes == sum(f.size for f in manifest.files) + 4096
    loaded = checkpointd.load(local_root.url).state["lora"]
    assert same(loaded, zeros)


def test_a_fully_changing_state_writes_everything(local_root: Root) -> None:
    with checkpointd.CheckpointWriter(local_root.url, incremental=True) as writer:
        for step in (1, 2):
            state = {"model": {"w": torch.full((64, 64), float(step))}}
            info = writer.save(step, state).result()
            assert info.referenced_nbytes == 0
    assert checkpointd.load(local_root.url).state["model"]["w"][0, 0] == 2.0


def test_full_saves_keep_schema_1_and_incremental_needs_a_bool(local_root: Root) -> None:
    with checkpointd.CheckpointWriter(local_root.url) as writer:
        writer.save(1, {"m": torch.zeros(64, 64)}).result()
    manifest = catalog.read_manifest(open_store(local_root.url), 1)
    assert manifest.schema_version == 1
    assert manifest.blobs == []
    with pytest.raises(InvalidArgumentError, match="incremental"):
        checkpointd.CheckpointWriter(local_root.url, incremental="yes")  # type: ignore[arg-type]


def test_async_writer_saves_incrementally(local_root: Root) -> None:
    base = frozen_base()

    async def main() -> Any:
        async with checkpointd.AsyncCheckpointWriter(local_root.url, incremental=True) as writer:
            for step in (1, 2):
                info = await (await writer.save(step, lora_state(step, base))).wait()
        return info

    info = anyio.run(main)
    assert info.referenced_nbytes == sum(t.numel() * 4 for t in base.values())


def test_incremental_with_many_ranks_is_refused(
    local_root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    from checkpointd.write import opening

    closed: list[bool] = []

    class TwoRanks:
        world_size = 2

        def close(self) -> None:
            closed.append(True)

    monkeypatch.setattr(opening, "open_group", lambda *_: TwoRanks())
    with pytest.raises(InvalidArgumentError, match="2 ranks"):
        checkpointd.CheckpointWriter(local_root.url, incremental=True)
    assert closed == [True]


def test_a_tensor_unchanged_at_the_last_save_is_hashed_at_capture_not_copied(
    local_root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = frozen_base()
    savers: list[IncrementalSaver] = []  # the writer's, made when it opens
    real_init = IncrementalSaver.__init__

    def init(self: IncrementalSaver, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        savers.append(self)

    monkeypatch.setattr(IncrementalSaver, "__init__", init)
    with checkpointd.CheckpointWriter(local_root.url, incremental=True) as writer:
        (saver,) = savers
        writer.save(1, lora_state(1, base)).result()  # writes the base
        writer.save(2, lora_state(2, base)).result()  # finds it unchanged in the background
        assert saver.stats.prehashed == 0
        writer.save(3, lora_state(3, base)).result()  # hashes it at capture: never copied
        assert saver.stats.prehashed == len(base)
        before = base["layer0.weight"].clone()
        base["layer0.weight"].add_(1.0)  # one base tensor changes: copied and written again
        info = writer.save(4, lora_state(4, base)).result()
        assert saver.stats.prehashed == len(base) - 1
        assert saver.stats.written == 3  # the changed base tensor, the adapter, exp_avg
    assert info.step == 4
    for step in (3, 4):
        loaded = checkpointd.load(local_root.url, step=step).state["model"]
        for name, tensor in base.items():
            expected = before if (step, name) == (3, "layer0.weight") else tensor
            assert torch.equal(loaded[name], expected), (step, name)


def test_a_blob_deleted_under_an_uncopied_tensor_fails_the_save_and_the_next_copies(
    local_root: Root,
) -> None:
    base = frozen_base()
    store = open_store(local_root.url)
    with checkpointd.CheckpointWriter(local_root.url, incremental=True) as writer:
        for step in (1, 2):
            writer.save(step, lora_state(step, base)).result()
        for name in _blobs(store):  # another process deletes every shared blob
            store.remove_file(blob_path(name))
        with pytest.raises(checkpointd.CheckpointError, match="no longer stored"):
            writer.save(3, lora_state(3, base)).result()
        writer.save(4, lora_state(4, base)).result()  # copies and writes everything again
    assert [i.step for i in checkpointd.list_checkpoints(local_root.url)] == [1, 2, 4]
    assert same(
        checkpointd.load(local_root.url, step=4).state["model"], lora_state(4, base)["model"]
    )


@pytest.mark.parametrize("keep_last", [None, 1])
def test_a_tensor_back_at_an_earlier_value_while_a_save_is_writing(
    local_root: Root, monkeypatch: pytest.MonkeyPatch, keep_last: int | None
) -> None:
    """max_pending=2: save 3 is captured while save 2 is held, so capture checks it
    against what save 1 found unchanged (zeros), though save 2 wrote ones; and with
    keep_last=1 the retention after save 2 drops step 1, the only one listing zeros."""
    frozen = torch.randn(32, 32, generator=torch.Generator().manual_seed(7))
    values = {0: 0.0, 1: 0.0, 2: 1.0, 3: 0.0, 4: 0.0}  # an accumulator reset to zeros

    def state(step: int) -> dict[str, Any]:
        return {"model": {"frozen": frozen, "acc": torch.full((32, 32), values[step])}}

    with checkpointd.CheckpointWriter(
        local_root.url, incremental=True, max_pending=2, keep_last=keep_last
    ) as writer:
        for step in (0, 1):
            writer.save(step, state(step)).result()
        gate = hold_local_writes(monkeypatch)  # save 2 waits at its first storage call
        second = writer.save(2, state(2))
        third = writer.save(3, state(3))  # captured while 2 is in flight
        assert not second.done()
        gate.set()
        second.result()
        third.result()
        writer.save(4, state(4)).result()
    store = open_store(local_root.url)
    steps = [4] if keep_last else [0, 1, 2, 3, 4]
    assert [i.step for i in checkpointd.list_checkpoints(local_root.url)] == steps
    for step in steps:
        assert same(checkpointd.load(local_root.url, step=step).state, state(step))
        assert verify_step(store, step, catalog.read_manifest(store, step)) == []
    assert store.list_dir(PINS_DIR) == []
    assert _blobs(store) == _used(store)  # nothing left behind for gc
