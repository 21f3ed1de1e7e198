"""checkpointd import / export --format hf|dcp: the three foreign kinds, round trips, refusals."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import checkpointd
from checkpointd.interop.export import export_dcp, export_hf
from checkpointd.interop.foreign import import_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(50, 8, generator=gen).to(torch.bfloat16),
        "layer.0.weight": torch.randn(8, 8, generator=gen),
        "layer.0.bias": torch.randn(8, generator=gen).half(),
        "steps": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit for bit: names, dtypes, shapes and bytes."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and a[k].contiguous().view(torch.uint8).equal(b[k].contiguous().view(torch.uint8))
        for k in a
    )


def _hf_folder(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    folder.mkdir()
    names = list(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[:2],
        "model-00002-of-00002.safetensors": names[2:],
    }
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(folder / file))
        weight_map.update(dict.fromkeys(keys, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_hf_import_then_export_is_bit_exact(tmp_path: Path) -> None:
    tensors = _tensors()
    _hf_folder(tmp_path / "hf", tensors)
    done = import_checkpoint(str(tmp_path / "hf"), str(tmp_path / "root"), step=7)
    assert (done.kind, done.step, done.components) == ("hf", 7, ("model",))
    export_hf(str(tmp_path / "root"), "model", str(tmp_path / "out"), shard_bytes=300)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    back: dict[str, torch.Tensor] = {}
    for file in set(index["weight_map"].values()):
        back.update(load_file(str(tmp_path / "out" / file)))
    assert _same(tensors, back)


def test_safetensors_file_import(tmp_path: Path) -> None:
    tensors = _tensors()
    save_file(tensors, str(tmp_path / "w.safetensors"))
    import_checkpoint(str(tmp_path / "w.safetensors"), str(tmp_path / "root"), component="weights")
    assert _same(tensors, checkpointd.load(str(tmp_path / "root")).state["weights"])


def test_dcp_import_then_export_is_bit_exact_and_dcp_loadable(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {"model": {**_tensors(), **model.state_dict()}, "optimizer": opt.state_dict()}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    done = import_checkpoint(str(tmp_path / "dcp"), str(tmp_path / "root"), step=3)
    assert (done.kind, done.components) == ("dcp", ("model", "optimizer"))
    assert _same(state["model"], checkpointd.load(str(tmp_path / "root")).state["model"])
    export_dcp(str(tmp_path / "root"), str(tmp_path / "out"))
    back: dict[str, Any] = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
    dcp.load(back, checkpoint_id=str(tmp_path / "out"), no_dist=True)
    assert _same(state["model"], back["model"])
    fresh_opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    loaded = checkpointd.load(str(tmp_path / "root")).state["optimizer"]
    fresh_opt.load_state_dict(loaded)
    assert fresh_opt.param_groups[0]["lr"] == 0.1
    assert torch.equal(fresh_opt.state[model.weight]["exp_avg"], opt.state[model.weight]["exp_avg"])


def test_lightning_ckpt_import(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    ckpt = {
        "epoch": 2,
        "global_step": 40,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": model.state_dict(),
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [sched.state_dict()],
        "loops": {"fit_loop": {"epoch_progress": {"current": 2}}},
    }
    torch.save(ckpt, tmp_path / "last.ckpt")
    done = import_checkpoint(str(tmp_path / "last.ckpt"), str(tmp_path / "root"))
    assert done.step == 40
    assert done.components == ("model", "optimizer", "scheduler", "lightning")
    state = checkpointd.load(str(tmp_path / "root")).state
    assert torch.equal(state["model"]["weight"], model.weight)
    assert state["lightning"]["epoch"] == 2


class _Boom:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


def test_torch_save_file_with_code_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    torch.save({"w": torch.zeros(2), "evil": _Boom(str(marker))}, tmp_path / "bad.pt")
    with pytest.raises(checkpointd.CorruptCheckpointError, match="weights_only"):
        import_checkpoint(str(tmp_path / "bad.pt"), str(tmp_path / "root"))
    assert not marker.exists()
    assert not (tmp_path / "root").exists() or not os.listdir(tmp_path / "root")


def test_dcp_metadata_with_code_is_refused_without_running(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.zeros(3)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    marker = tmp_path / "ran"
    metadata_path = tmp_path / "dcp" / ".metadata"
    with open(metadata_path, "rb") as f:
        metadata = pickle.load(f)  # our own file, written just above
    metadata.planner_data["evil"] = _Boom(str(marker))
    metadata_path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(checkpointd.CorruptCheckpointError, match=r"posix\.system|os\.system"):
        import_checkpoint(str(tmp_path / "dcp"), str(tmp_path / "root"))
    # And a bare payload in place of the metadata.
    metadata_path.write_bytes(pickle.dumps(_Boom(str(marker))))
    with pytest.raises(checkpointd.CorruptCheckpointError, match="refused without running it"):
        import_checkpoint(str(tmp_path / "dcp"), str(tmp_path / "root"))
    assert not marker.exists()


def test_cli_import_and_export(tmp_path: Path) -> None:
    save_file(_tensors(), str(tmp_path / "w.safetensors"))
    run = [sys.executable, "-m", "checkpointd"]
    with warnings.catch_warnings():
        out = subprocess.run(
            [
                *run,
                "import",
                str(tmp_path / "w.safetensors"),
                str(tmp_path / "root"),
                "--step",
                "5",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    assert "imported safetensors checkpoint" in out
    assert "as step 5" in out
    out = subprocess.run(
        [
            *run,
            "export",
            str(tmp_path / "root"),
            "--component",
            "model",
            "--format",
            "hf",
            "--to",
            str(tmp_path / "hf"),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "Hugging Face folder" in out
    failed = subprocess.run(
        [*run, "export", str(tmp_path / "root"), "--format", "hf", "--to", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert failed.returncode == 1
    assert "needs --component" in failed.stderr


def _bit_equal(a: Any, b: Any, path: str = "") -> None:
    """Assert two state trees hold the same values bit for bit, type for type."""
    import numpy as np

    if isinstance(a, dict) and isinstance(b, dict):  # an OrderedDict state_dict comes back a dict
        assert a.keys() == b.keys(), path
        for key in a:
            _bit_equal(a[key], b[key], f"{path}/{key}")
        return
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert _same({path: a.reshape(-1)}, {path: b.reshape(-1)}), path
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
    elif isinstance(a, np.ndarray | np.generic):
        assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()), path
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _bit_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b or repr(a) == repr(b), f"{path}: {a!r} != {b!r}"  # repr: NaN == NaN


def test_dcp_export_then_import_of_a_demo_like_state_with_rng_is_bit_exact(
    tmp_path: Path,
) -> None:
    """RNGState's NumPy keys (and NumPy values anywhere) come back without running pickle
    code: export stores them as torch.save bytes, import admits only NumPy's array and
    scalar rebuilders (issue 19)."""
    import numpy as np

    torch.manual_seed(0)
    np.random.seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched.step()
    progress = checkpointd.TrainingProgress()
    progress.record(samples=3, loss=0.25)
    state = {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "rng": checkpointd.RNGState(),
        "progress": progress,
        "extra": {"scalar": np.float32(1.5), "ints": np.arange(4, dtype=np.int16), "n": 3},
    }
    with checkpointd.CheckpointWriter(str(tmp_path / "a")) as writer:
        writer.save(4, state).result(timeout=60)
    export_dcp(str(tmp_path / "a"), str(tmp_path / "dcp"))
    done = import_checkpoint(str(tmp_path / "dcp"), str(tmp_path / "b"), step=4)
    assert set(done.components) == set(state)
    _bit_equal(
        checkpointd.load(str(tmp_path / "a")).state, checkpointd.load(str(tmp_path / "b")).state
    )
    np.random.seed(1)
    torch.manual_seed(1)
    checkpointd.restore(str(tmp_path / "b"), {"rng": checkpointd.RNGState()}, strict=False)
    after = (np.random.rand(), torch.rand(1))
    checkpointd.restore(str(tmp_path / "a"), {"rng": checkpointd.RNGState()}, strict=False)
    assert after == (np.random.rand(), torch.rand(1))


def test_dcp_round_trip_keeps_empty_mappings(tmp_path: Path) -> None:
    """DCP's flattening drops empty dicts (a fresh optimizer's ``state``, an empty
    history); export records where they were and import puts them back."""
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # never stepped: state == {}
    state = {
        "model": model,
        "optimizer": opt,
        "progress": checkpointd.TrainingProgress(),  # history == {}
        "extra": {"empty": {}, "nested": {"deeper": {}, "n": 1}},
    }
    with checkpointd.CheckpointWriter(str(tmp_path / "a")) as writer:
        writer.save(1, state).result(timeout=60)
    export_dcp(str(tmp_path / "a"), str(tmp_path / "dcp"))
    import_checkpoint(str(tmp_path / "dcp"), str(tmp_path / "b"), step=1)
    _bit_equal(
        checkpointd.load(str(tmp_path / "a")).state, checkpointd.load(str(tmp_path / "b")).state
    )
    back: dict[str, Any] = {
        "model": {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    }
    dcp.load(back, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)  # torch still reads it
    assert _same(model.state_dict(), back["model"])
