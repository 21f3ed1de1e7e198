"""The benchmark suite's entry point runs end to end in its smallest mode (not a timed test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import run


@pytest.mark.timeout(60)
def test_benchmark_suite_smoke(tmp_path: Path) -> None:
    out = tmp_path / "results"
    assert run.main(["--smoke", "--dir", str(tmp_path), "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    for section in ("large", "small", "training", "s3", "scaling"):
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
    ):
        assert results["series"][name]["median"] > 0, name
    assert "restore, fresh process" in results["ratios"]
    assert "checkpointd / torch" in capsys.readouterr().out


@pytest.mark.timeout(90)
def test_service_benchmark_smoke(tmp_path: Path) -> None:
    from benchmarks import bench_service

    out = tmp_path / "service.json"
    assert bench_service.main(["--smoke", "--dir", str(tmp_path), "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    for name in ("inproc.blocked", "service.blocked", "service.durable", "restore.memory"):
        assert results["series"][name]["median"] > 0, name
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
