"""checkpointd.build(): rebuild from specs alone, partial builds, validators, local and S3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import checkpointd
from checkpointd.rebuild.build import BUILTIN_ALLOW
from tests.conftest import Root
from tests.support.specmodels import Counter, Net, train

ALLOW = ("tests.support.specmodels", *BUILTIN_ALLOW)
REPO = Path(__file__).resolve().parents[2]


def _job(width: int = 8, seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = Net(width, depth=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    train(model, opt, sched, 5, seed=1)
    return {"model": model, "optimizer": opt, "scheduler": sched, "counter": Counter(7)}


def _specs(width: int = 8) -> dict[str, Any]:
    return {
        "model": checkpointd.spec(Net, width, depth=2),
        "optimizer": checkpointd.spec(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
        "scheduler": checkpointd.spec(torch.optim.lr_scheduler.StepLR, step_size=3, gamma=0.5),
        "counter": checkpointd.spec(Counter),
    }


def _save(root: Root, state: dict[str, Any], specs: dict[str, Any], step: int = 5) -> None:
    with checkpointd.CheckpointWriter(root.url, storage_options=root.storage_options) as writer:
        writer.save(step, state, specs=specs).result(timeout=60)


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_build_continues_training_exactly(kind: str, request: pytest.FixtureRequest) -> None:
    root: Root = request.getfixturevalue(f"{kind}_root")
    job = _job()
    _save(root, job, _specs())
    built = checkpointd.build(root.url, allow=ALLOW, storage_options=root.storage_options)
    assert set(built) == {"model", "optimizer", "scheduler", "counter"}
    assert built["counter"].count == 7
    assert built["scheduler"].optimizer is built["optimizer"]
    params = {id(p) for p in built["model"].parameters()}
    assert all(id(p) in params for g in built["optimizer"].param_groups for p in g["params"])
    expected = train(job["model"], job["optimizer"], job["scheduler"], 6, seed=2)
    got = train(built["model"], built["optimizer"], built["scheduler"], 6, seed=2)
    assert got == expected
    for a, b in zip(job["model"].parameters(), built["model"].parameters(), strict=True):
        assert torch.equal(a, b)


def test_build_in_a_fresh_process_without_construction_code(tmp_path: Path) -> None:
    job = _job()
    _save(Root(str(tmp_path)), job, _specs())
    expected = train(job["model"], job["optimizer"], job["scheduler"], 4, seed=3)
    script = (
        "import json, sys, checkpointd\n"
        "from tests.support.specmodels import train\n"
        "allow = ('tests.support.specmodels', *checkpointd.BUILTIN_ALLOW)\n"
        "o = checkpointd.build(sys.argv[1], allow=allow)\n"
        "print(json.dumps(train(o['model'], o['optimizer'], o['scheduler'], 4, seed=3)))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == expected


def test_components_bring_associated_objects(local_root: Root) -> None:
    _save(local_root, _job(), _specs())
    assert set(checkpointd.build(local_root.url, components=["model"], allow=ALLOW)) == {
        "model",
        "optimizer",
        "scheduler",
    }
    # Naming a scheduler brings what it is built over.
    assert set(checkpointd.build(local_root.url, components=["scheduler"], allow=ALLOW)) == {
        "model",
        "optimizer",
        "scheduler",
    }
    assert set(checkpointd.build(local_root.url, components=["counter"], allow=ALLOW)) == {
        "counter"
    }
    with pytest.raises(checkpointd.CheckpointNotFoundError, match="no spec"):
        checkpointd.build(local_root.url, components=["nope"], allow=ALLOW)


def test_map_location_moves_models(local_root: Root) -> None:
    _save(local_root, _job(), _specs())
    built = checkpointd.build(local_root.url, allow=ALLOW, map_location="cpu")
    assert next(built["model"].parameters()).device.type == "cpu"


def test_validators_refuse_and_see_info(local_root: Root) -> None:
    _save(local_root, _job(), _specs())
    seen: list[tuple[str, int]] = []

    def record(name: str, obj: Any, info: checkpointd.CheckpointInfo) -> None:
        seen.append((name, info.step))

    def no_counter(name: str, obj: Any, info: checkpointd.CheckpointInfo) -> None:
        if name == "counter" and obj.count > 5:
            raise ValueError("count too high")

    checkpointd.build(local_root.url, allow=ALLOW, validators=[record])
    assert sorted(seen) == [("counter", 5), ("model", 5), ("optimizer", 5), ("scheduler", 5)]
    with pytest.raises(
        checkpointd.ValidationFailedError, match=r"refused 'counter'.*count too high"
    ):
        checkpointd.build(local_root.url, allow=ALLOW, validators=[no_counter])


def test_state_that_does_not_fit_the_spec_fails_whole(local_root: Root) -> None:
    job = _job(width=8)
    _save(local_root, job, {**_specs(16), "model": checkpointd.spec(Net, 16, depth=2)})
    with pytest.raises(checkpointd.RestoreMismatchError):
        checkpointd.build(local_root.url, allow=ALLOW)


def test_checkpoint_without_specs(local_root: Root) -> None:
    with checkpointd.CheckpointWriter(local_root.url) as writer:
        writer.save(1, {"counter": Counter(1)}).result(timeout=60)
    with pytest.raises(checkpointd.CheckpointNotFoundError, match="without specs"):
        checkpointd.build(local_root.url, allow=ALLOW)


def _exported_classes() -> set[str]:
    """Every public module, optimizer and scheduler class torch.nn / torch.optim export."""
    import inspect

    from torch.optim.lr_scheduler import LRScheduler

    bases = (torch.nn.Module, torch.optim.Optimizer, LRScheduler)
    found = set()
    for ns in (torch.nn, torch.optim, torch.optim.lr_scheduler, torch.optim.swa_utils):
        for name in dir(ns):
            obj = getattr(ns, name)
            if not name.startswith("_") and inspect.isclass(obj) and issubclass(obj, bases):
                found.add(f"{obj.__module__}.{obj.__qualname__}")
    return found


def test_builtin_allow_names_only_public_torch_classes() -> None:
    """Exact class paths, no prefixes: a torch.nn function is not admitted (issue 19)."""
    import importlib

    from torch.optim.lr_scheduler import LRScheduler

    assert checkpointd.BUILTIN_ALLOW is BUILTIN_ALLOW
    assert _exported_classes() <= set(BUILTIN_ALLOW)
    for path in BUILTIN_ALLOW:
        assert not any(p.startswith("_") for p in path.split(".")), path
        module, _, name = path.rpartition(".")
        obj = getattr(importlib.import_module(module), name)
        assert issubclass(obj, (torch.nn.Module, torch.optim.Optimizer, LRScheduler)), path
        assert f"{obj.__module__}.{obj.__qualname__}" == path
    for spec in _specs().values():
        if spec.module.startswith("torch."):
            assert spec.path in BUILTIN_ALLOW


def test_builtin_allow_at_the_root_imports_no_torch() -> None:
    code = (
        "import sys, checkpointd\n"
        "assert 'torch.optim.adamw.AdamW' in checkpointd.BUILTIN_ALLOW\n"
        "assert 'torch' not in sys.modules"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)


def test_build_logs_the_strict_false_skip_once(
    local_root: Root, caplog: pytest.LogCaptureFixture
) -> None:
    """build() restores with strict=False on every call; the skip is logged once (issue 19)."""
    import logging

    _save(local_root, {**_job(), "extra": Counter(1)}, _specs())  # "extra" has no spec
    with caplog.at_level(logging.WARNING, logger="checkpointd"):
        for _ in range(3):
            checkpointd.build(local_root.url, allow=ALLOW)
    skips = [r for r in caplog.records if "strict=False" in r.getMessage()]
    assert len(skips) == 1, [r.getMessage() for r in skips]
    assert "['extra']" in skips[0].getMessage()
