"""The command line on an incremental root: ls and inspect show written and referenced
bytes, verify follows references, gc keeps shared blobs newer steps use, export
writes a self-contained file."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

import checkpointd
from checkpointd.cli.output import size_text
from checkpointd.format.layout import BLOBS_DIR, blob_path
from checkpointd.read import catalog
from checkpointd.storage import Store, open_store
from tests.conftest import Root
from tests.faults.helpers import same
from tests.integration.test_cli import run
from tests.integration.test_incremental import _stored_bytes

BASE = {f"layer{i}.weight": torch.full((128, 128), float(i)) for i in range(3)}
"""Three 64 KiB tensors: blobs at the default INCREMENTAL_MIN_BYTES."""


def _state(step: int) -> dict[str, object]:
    return {"model": {**BASE, "lora": torch.full((128, 128), -float(step))}, "step": step}


def _populate(root: Root) -> None:
    with checkpointd.CheckpointWriter(root.url, incremental=True) as writer:
        for step in (1, 2, 3):
            writer.save(step, _state(step)).result()


def test_ls_and_inspect_show_written_and_referenced_bytes(local_root: Root) -> None:
    _populate(local_root)
    rows = json.loads(run(local_root, "ls", local_root.url, "--json").stdout)
    assert [r["referenced_nbytes"] for r in rows] == [0, 3 * 65536, 3 * 65536]
    assert all(r["written_nbytes"] + r["referenced_nbytes"] == r["nbytes"] for r in rows)
    table = run(local_root, "ls", local_root.url).stdout
    assert "written" in table
    assert "referenced" in table
    shown = run(local_root, "inspect", local_root.url, "--step", "2").stdout
    assert "shared    4 blobs" in shown
    assert "references 192.0 KiB" in shown
    described = json.loads(run(local_root, "inspect", local_root.url, "--json").stdout)
    assert described["referenced_nbytes"] == 3 * 65536
    shared = [t for t in described["components"]["model"]["tensors"] if t.get("shared")]
    assert len(shared) == 4
    assert all(t["file"].startswith(f"{BLOBS_DIR}/") for t in shared)


def test_verify_reports_a_damaged_shared_blob_for_every_step(local_root: Root) -> None:
    _populate(local_root)
    assert "all sizes and CRC32C match" in run(local_root, "verify", local_root.url, "--all").stdout
    store = open_store(local_root.url)
    blob = catalog.read_manifest(store, 3).components["model"].refs["layer1.weight"].blob
    path = os.path.join(local_root.url, blob_path(blob))
    with open(path, "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    done = run(local_root, "verify", local_root.url, "--all", check=1)
    assert done.stdout.count(f"{blob_path(blob)} (shared): its bytes hash to") == 3
    listed = json.loads(run(local_root, "ls", local_root.url, "--verify", "--json", check=1).stdout)
    assert all(row["damaged"] for row in listed)


def test_gc_keeps_shared_blobs_and_export_is_self_contained(
    local_root: Root, tmp_path: Path
) -> None:
    _populate(local_root)
    run(local_root, "gc", local_root.url, "--keep-last", "1", "--apply")
    store = open_store(local_root.url)
    assert [s for s, _ in catalog.committed(store)] == [3]
    used = {b.name for b in catalog.read_manifest(store, 3).blobs}
    assert set(store.list_dir(BLOBS_DIR)) == used  # steps 1 and 2's adapters are gone
    target = str(tmp_path / "model.safetensors")
    run(local_root, "export", local_root.url, "--component", "model", "--to", target)
    from safetensors.torch import load_file

    assert same(load_file(target), _state(3)["model"])


def _files_bytes(store: Store, step: int) -> int:
    return sum(f.size for f in catalog.read_manifest(store, step).files)


def test_verify_all_reports_bytes_read_with_shared_blobs_once(local_root: Root) -> None:
    _populate(local_root)
    store = open_store(local_root.url)
    read = sum(_files_bytes(store, s) for s in (1, 2, 3)) + 6 * 65536  # 3 base + 3 adapters
    shown = run(local_root, "verify", local_root.url, "--all").stdout
    assert f"verified 3 checkpoint(s), {size_text(read)} read:" in shown
    assert f"step 1: {len(catalog.read_manifest(store, 1).files)} files + 4 shared blobs, " in shown
    assert "step 2: " in shown
    assert "+ 4 shared blobs (3 checked before), " in shown
    step3 = _files_bytes(store, 3) + 65536
    assert f"(3 checked before), {size_text(step3)} read: ok" in shown


def test_gc_rows_and_total_both_count_freed_bytes(local_root: Root) -> None:
    _populate(local_root)
    store = open_store(local_root.url)
    frees = {s: _files_bytes(store, s) + 65536 for s in (1, 2)}  # own files + own adapter
    before = _stored_bytes(store)
    shown = run(local_root, "gc", local_root.url, "--keep-last", "1").stdout
    for step, nbytes in frees.items():
        assert re.search(rf"delete  step +{step}  frees {re.escape(size_text(nbytes))}\n", shown)
    assert f"would free {size_text(sum(frees.values()))};" in shown
    applied = run(local_root, "gc", local_root.url, "--keep-last", "1", "--apply").stdout
    assert f"freed {size_text(sum(frees.values()))}" in applied
    assert before - _stored_bytes(store) == sum(frees.values())


def test_gc_names_shared_blobs_only_deleted_steps_use(local_root: Root) -> None:
    with checkpointd.CheckpointWriter(local_root.url, incremental=True) as writer:
        writer.save(1, {"model": dict(BASE)}).result()
        writer.save(2, {"model": dict(BASE)}).result()
        other = {k: v + 10 for k, v in BASE.items()}
        writer.save(3, {"model": other}).result()
    store = open_store(local_root.url)
    shown = run(local_root, "gc", local_root.url, "--keep-last", "1").stdout
    shared = 3 * 65536  # the base blobs: steps 1 and 2 use them, step 3 does not
    assert f"shared blobs only deleted steps use  frees {size_text(shared)}" in shown
    total = _files_bytes(store, 1) + _files_bytes(store, 2) + shared
    assert f"would free {size_text(total)};" in shown
