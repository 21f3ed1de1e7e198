"""The benchmark suite's entry point runs end to end in its smallest mode (not a timed test)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import run
from benchmarks.common import starting_with
from tests.support import zygote


@pytest.fixture(autouse=True)
def _children_forked() -> Iterator[None]:
    """The benchmarks' ``python -m`` children of this checkout (services, ranks, trainers,
    fresh-process loads) fork from the session's zygote instead of each paying torch's
    import: their figures are not checked here, that they run is (--before rows stay new
    interpreters; CHECKPOINTD_TEST_ZYGOTE=0: every child one)."""
    with starting_with(zygote.popen):
        yield


@pytest.mark.timeout(300)  # seven sections; 151 s at load average 10 on 2 cores
def test_benchmark_suite_smoke(tmp_path: Path) -> None:
    out = tmp_path / "results"
    assert run.main(["--smoke", "--dir", str(tmp_path), "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    for section in ("large", "small", "training", "s3", "scaling", "load", "window"):
        assert section in results, section
    case = next(iter(results["large"].values()))
    for name in (
        "memcpy",
        "raw",
        "checkpointd.blocked",
        "checkpointd.durable",
        "dcp_async.blocked",
    ):
        assert case["series"][name]["median"] > 0, name
    assert results["small"]["series"]["checkpointd.durable"]["median"] > 0
    assert results["training"]["step_idle"]["values"]
    assert results["s3"]["mib_per_s"]["checkpointd 1 file"] > 0
    stall = results["stall"]  # the many-rank stall, phase by phase, beside one process's
    for kind in ("ranked", "local"):
        assert stall["phases"][kind]["blocked"] >= stall["phases"][kind]["copy"] > 0, kind
    assert stall["phases"]["ranked"]["by_name"] > 0
    assert [r["ranked/local"] > 0 for r in stall["ratios"]] == [True, True]
    load = results["load"]["series"]
    for process in ("fresh", "long_lived"):
        for loader in ("torch.load", "checkpointd.load"):
            assert load[f"{loader}.{process}"]["median"] > 0, (loader, process)
    assert len(load["checkpointd.load.long_lived"]["values"]) == 2  # repeated in one process
    window = results["window"]
    for kind in ("idle", "inproc", "service"):
        assert window["series"][f"{kind}.tokens_per_s"]["median"] > 0, kind
    for kind in ("inproc", "service"):
        assert window["series"][f"{kind}.durable"]["median"] > 0, kind
        assert window["ratios"][kind] > 0, kind
    peers = results["peers"]["local disk (cold cache)"]  # a lost node of 4, replicas=1
    for name, series in peers["series"].items():
        assert series["median"] > 0, name
    assert {f"restore.{k}.lost" for k in ("peer", "storage")} <= peers["series"].keys()
    assert peers["sources"] == {
        "peer": ["memory", "memory", "memory", "peer"],
        "storage": ["memory", "memory", "memory", "storage"],
    }
    assert peers["exact"] is True
    assert peers["shares"] > 0
    assert 0.9 <= peers["bytes_sent_per_save"] / peers["shares"] <= 1.1  # each share once
    assert [r["nbytes"] for r in results["scaling"]["rows"]] == sorted(
        r["nbytes"] for r in results["scaling"]["rows"]
    )
    pngs = {p.name for p in out.glob("*.png")}
    assert {"large_0.png", "small.png", "training.png", "s3.png", "scaling.png"} <= pngs
    assert not list(tmp_path.glob("checkpointd-bench-*")), "work folders must be removed"


@pytest.mark.timeout(60)
def test_incremental_benchmark_smoke(tmp_path: Path) -> None:
    from benchmarks import bench_incremental

    out, png = tmp_path / "incremental.json", tmp_path / "incremental.png"
    args = ["--smoke", "--dir", str(tmp_path), "--json", str(out), "--plot", str(png)]
    assert bench_incremental.main(args) == 0
    assert png.stat().st_size > 0
    results = json.loads(out.read_text())
    lora = results["lora"]
    # The frozen base is referenced, not written again: only the changing bytes are.
    assert lora["incremental"]["written_median"] < lora["full"]["written_median"] / 4
    assert lora["incremental"]["storage_bytes"] < lora["full"]["storage_bytes"]
    assert results["changing"]["incremental"]["written_median"] > 0
    assert not list(tmp_path.glob("checkpointd-bench-*")), "work folders must be removed"


@pytest.mark.timeout(240)
def test_incremental_benchmark_with_two_ranks_smoke(tmp_path: Path) -> None:
    from benchmarks import bench_incremental

    out = tmp_path / "incremental.json"
    args = ["--smoke", "--cases", "lora-ranks", "--dir", str(tmp_path), "--json", str(out)]
    assert bench_incremental.main(args) == 0
    ranked = json.loads(out.read_text())["lora-ranks"]
    # the sharded base is referenced: only about the changed bytes are written again
    changed = ranked["changed_bytes_per_save"]
    assert changed <= ranked["incremental"]["written_median"] <= 1.1 * changed
    assert ranked["full"]["written_median"] > 4 * changed
    assert not list(tmp_path.glob("checkpointd-bench-*")), "work folders must be removed"


def test_overlap_benchmark_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import bench_overlap

    results = bench_overlap.main(["--smoke", "--dir", str(tmp_path)])
    for mode in ("blocking", "overlapped"):
        for figure in ("blocked", "staged"):
            assert results["median"][mode][figure] > 0, (mode, figure)
        assert len(results["raw"][mode]["stall"]) == 2
    assert "overlapped" in capsys.readouterr().out
    assert not list(tmp_path.glob("checkpointd-bench-*")), "work folders must be removed"


@pytest.mark.timeout(60)
def test_gpu_staging_benchmark_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without CUDA it says so and exits 0; with CUDA it runs its tiny mode."""
    import torch

    from benchmarks import bench_gpu_staging

    assert bench_gpu_staging.main(["--smoke", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    if torch.cuda.is_available():
        assert "D2H floor" in out
    else:
        assert "no CUDA device" in out


@pytest.mark.timeout(120)
def test_restore_benchmark_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import bench_restore

    out = tmp_path / "restore.json"
    assert bench_restore.main(["--smoke", "--dir", str(tmp_path), "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    for name in (
        "memcpy",
        "torch.load",
        "checkpointd.load",
        "torch.restore",
        "checkpointd.read.restore",
        "torch.fresh",
        "checkpointd.fresh",
        "torch.load.fresh",
        "checkpointd.load.fresh",
    ):
        assert results["series"][name]["median"] > 0, name
    assert "restore, fresh process" in results["ratios"]
    assert "load, fresh process" in results["ratios"]
    assert "checkpointd / torch" in capsys.readouterr().out


@pytest.mark.timeout(180)  # with a 2-rank FSDP2 job and four more services
def test_service_benchmark_smoke(tmp_path: Path) -> None:
    from benchmarks import bench_service

    out = tmp_path / "service.json"
    assert bench_service.main(["--smoke", "--dir", str(tmp_path), "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    series = ("inproc.blocked", "service.blocked", "service.durable", "restore.memory")
    series += ("fsdp2.inproc.blocked", "fsdp2.service.blocked", "fsdp2.service.durable")
    for name in series:
        assert results["series"][name]["median"] > 0, name
    assert results["fsdp2"]["durable service/inproc"] > 0
    kill = results["kill9"]
    assert kill["returned"] >= 1
    assert kill["committed_bit_exact"] == kill["returned"]
    assert not list(tmp_path.glob("checkpointd-bench-*")), "work folders must be removed"


def test_transformers_benchmark_smoke() -> None:
    pytest.importorskip("transformers")
    from benchmarks import bench_transformers

    tiny = ["--repeat", "1", "--steps", "4", "--every", "2", "--width", "32", "--layers", "1"]
    summary = bench_transformers.main(tiny)
    assert set(summary) == {"trainer", "checkpointd"}
    assert all(row["saves"] == 2 and row["blocked_ms"] > 0 for row in summary.values())


@pytest.mark.timeout(120)
def test_torchtitan_benchmark_smoke() -> None:
    pytest.importorskip("torchtitan")
    from benchmarks import bench_torchtitan

    tiny = ["--repeat", "1", "--steps", "4", "--every", "2", "--width", "32", "--layers", "1"]
    summary = bench_torchtitan.main(tiny)
    assert set(summary) == {"dcp", "checkpointd"}
    assert all(row["saves"] == 2 and row["blocked_ms"] > 0 for row in summary.values())


@pytest.mark.timeout(120)
def test_scale_model_quick(tmp_path: Path) -> None:
    """The scale model's quick mode runs the real commit on a real TCPStore; what it
    measures has the shapes the table of docs/performance.md relies on."""
    from benchmarks import bench_scale

    out, png = tmp_path / "scale.json", tmp_path / "scale.png"
    args = ["--quick", "--dir", str(tmp_path), "--json", str(out), "--plot", str(png)]
    assert bench_scale.main(args) == 0
    assert png.stat().st_size > 0
    rows = json.loads(out.read_text())["rows"]
    fsdp = [r for r in rows if r["layout"] == "fsdp"]
    assert [r["ranks"] for r in fsdp] == bench_scale.QUICK
    for row in rows:
        assert "refused" not in row
        assert row["decode_s"] is not None
        assert "publisher_error" not in row
        assert "follower_error" not in row
        # every rank's post read once (check + get), every component named on both ranks
        assert row["read_ops"] == 2 * row["ranks"]
        assert row["publisher"]["components"] == row["follower"]["components"] == row["ranks"] + 2
    # 70B over 8+ ranks passes SHARD_INDEX_MIN_ENTRIES: every rank's shard entries are in
    # its index file; the manifest lists none, and a rank's post is its checks only
    for row in rows:
        assert row["indexed"]
        assert row["shards_inline"] == 0
        assert row["shards"] > 0
        assert row["post_bytes_median"] < 2000
    assert [r["indexes"] for r in fsdp] == bench_scale.QUICK  # one index per rank
    # the manifest grows with the ranks' file entries only: far less than 4x over 4x ranks
    assert fsdp[-1]["manifest_bytes"] < 1.5 * fsdp[0]["manifest_bytes"]
    assert fsdp[-1]["index_bytes_median"] <= fsdp[0]["index_bytes_median"]
    # a restore onto the saving layout reads its own rank's index (HSDP: its replicas')
    assert all(r["restore_indexes"] == 1 for r in fsdp)
    hsdp = [r for r in rows if r["layout"].startswith("hsdp")]
    assert [r["restore_indexes"] for r in hsdp] == [r["ranks"] // 8 for r in hsdp]
    # followers wait in the store (one wait for the outcome, one for ``published``)
    assert all(r["follower"]["calls"]["wait"] >= 2 for r in rows)
    assert {r["layout"] for r in rows} >= {"fsdp", "hsdp2x8"}
    assert not list(tmp_path.glob("checkpointd-bench-*")), "work folders must be removed"


@pytest.mark.timeout(60)
def test_scale_model_a_manifest_too_large_fails_the_save_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks import bench_scale
    from checkpointd import tunables

    monkeypatch.setattr(tunables, "MAX_MANIFEST_BYTES", 2**20)
    monkeypatch.setattr(tunables, "SHARD_INDEX_MIN_ENTRIES", 2**62)  # inline, as before
    row = bench_scale.run_case(8, "fsdp", 8, 4, tmp_path)
    assert "MAX_MANIFEST_BYTES" in row["publisher_error"]
    assert row["follower_error"].startswith("RankFailedError")
    assert "MAX_MANIFEST_BYTES" in row["follower_error"]
    assert "MAX_MANIFEST_BYTES" in row["refused"]
    assert not list((tmp_path).rglob("manifest.json"))


@pytest.mark.timeout(240)
def test_restore_benchmark_runs_a_before_tree_beside_this_one(tmp_path: Path) -> None:
    """``bench_restore --before SRC``: the fresh-process load run from SRC joins the rotation
    (here SRC is this tree's own src, so both rows load the same code)."""
    from benchmarks import bench_restore

    out = tmp_path / "restore.json"
    src = Path(bench_restore.__file__).resolve().parents[1] / "src"
    args = ["--smoke", "--dir", str(tmp_path), "--json", str(out), "--before", str(src)]
    assert bench_restore.main(args) == 0
    results = json.loads(out.read_text())
    before = results["series"]["checkpointd.load.before.fresh"]["values"]
    assert len(before) == 2
    assert all(seconds > 0 for seconds in before), before
    assert len(results["series"]["checkpointd.load.fresh"]["values"]) == 2
    assert results["ratios"]["load, fresh process, --before"] > 0
    assert not list(tmp_path.glob("checkpointd-bench-*")), "work folders must be removed"
