"""spec() and save(specs=..., associations=...): what is recorded, what is refused."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import checkpointd
from checkpointd.read import catalog
from checkpointd.storage import open_store
from tests.support.specmodels import Counter, Net


def _setup(width: int = 8) -> dict[str, Any]:
    model = Net(width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    return {"model": model, "optimizer": opt, "scheduler": sched, "counter": Counter(3)}


def _specs(width: int = 8) -> dict[str, Any]:
    return {
        "model": checkpointd.spec(Net, width),
        "optimizer": checkpointd.spec(torch.optim.AdamW, lr=1e-3),
        "scheduler": checkpointd.spec(torch.optim.lr_scheduler.StepLR, step_size=10),
        "counter": checkpointd.spec(Counter, start=0),
    }


def _manifest(root: Path, step: int) -> Any:
    store = open_store(str(root))
    try:
        return catalog.read_manifest(store, step)
    finally:
        store.close()


def test_save_stores_specs_kinds_and_associations(tmp_path: Path) -> None:
    with checkpointd.CheckpointWriter(str(tmp_path)) as writer:
        writer.save(1, _setup(), specs=_specs()).result(timeout=60)
    specs = _manifest(tmp_path, 1).specs
    assert specs["model"].module == "tests.support.specmodels"
    assert (specs["model"].qualname, specs["model"].kind, specs["model"].args) == (
        "Net",
        "model",
        [8],
    )
    assert (specs["optimizer"].module, specs["optimizer"].qualname) == (
        "torch.optim.adamw",
        "AdamW",
    )
    assert (specs["optimizer"].kind, specs["optimizer"].of) == ("optimizer", "model")
    assert specs["optimizer"].params == [[n for n, _ in Net(8).named_parameters()]]
    assert (specs["scheduler"].kind, specs["scheduler"].of) == ("scheduler", "optimizer")
    assert (specs["counter"].kind, specs["counter"].kwargs) == ("object", {"start": 0})


def test_saves_without_specs_write_no_specs_member(tmp_path: Path) -> None:
    with checkpointd.CheckpointWriter(str(tmp_path)) as writer:
        writer.save(1, _setup()).result(timeout=60)
    assert _manifest(tmp_path, 1).specs == {}


@pytest.mark.parametrize(
    ("value", "where"),
    [
        (object(), "argument 0"),
        ({"a": [1, {2: 3}]}, "argument 0['a'][1]"),
        ([1, math.nan], "argument 0[1]"),
        (torch.zeros(1), "argument 0"),
        (2**70, "argument 0"),
        ("\udcff", "argument 0"),
    ],
)
def test_spec_refuses_non_json_arguments_with_their_path(value: Any, where: str) -> None:
    pattern = r"spec\(.*Net\) " + re.escape(where)
    with pytest.raises(checkpointd.UnsupportedValueError, match=pattern):
        checkpointd.spec(Net, value)


def test_spec_refuses_unimportable_callables() -> None:
    def local() -> None: ...

    with pytest.raises(checkpointd.InvalidArgumentError, match="not a Python identifier"):
        checkpointd.spec(local)
    with pytest.raises(checkpointd.InvalidArgumentError, match="module-level"):
        checkpointd.spec(42)  # type: ignore[arg-type]
    with pytest.raises(checkpointd.UnsupportedValueError, match="bytes"):
        checkpointd.spec(Net, ["x" * 1000] * 100)


def test_spec_refuses_huge_and_deep_arguments() -> None:
    deep: Any = 1
    for _ in range(200):
        deep = [deep]
    with pytest.raises(checkpointd.UnsupportedValueError, match="nested deeper"):
        checkpointd.spec(Net, deep)


def test_ambiguous_and_partial_optimizers_are_explained(tmp_path: Path) -> None:
    a, b = Net(4), Net(4)
    both = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    state = {"a": a, "b": b, "opt": both}
    specs = {"a": checkpointd.spec(Net, 4), "b": checkpointd.spec(Net, 4)}
    specs["opt"] = checkpointd.spec(torch.optim.SGD, lr=0.1)
    with checkpointd.CheckpointWriter(str(tmp_path)) as writer:
        with pytest.raises(
            checkpointd.InvalidArgumentError, match=r"models holding them: \{'a': 4, 'b': 4\}"
        ):
            writer.save(1, state, specs=specs)
        outer = torch.nn.Sequential(a)
        only_a = torch.optim.SGD(a.parameters(), lr=0.1)
        state = {"a": a, "outer": outer, "opt": only_a}
        specs = {"a": checkpointd.spec(Net, 4), "outer": checkpointd.spec(torch.nn.Sequential)}
        specs["opt"] = checkpointd.spec(torch.optim.SGD, lr=0.1)
        with pytest.raises(checkpointd.InvalidArgumentError, match="each hold all its parameters"):
            writer.save(1, state, specs=specs)
        writer.save(1, state, specs=specs, associations={"opt": "a"}).result(timeout=60)
    assert _manifest(tmp_path, 1).specs["opt"].of == "a"


def test_associations_are_checked(tmp_path: Path) -> None:
    state = _setup()
    with checkpointd.CheckpointWriter(str(tmp_path)) as writer:
        with pytest.raises(checkpointd.InvalidArgumentError, match="drives 'optimizer'"):
            writer.save(1, state, specs=_specs(), associations={"scheduler": "model"})
        with pytest.raises(checkpointd.InvalidArgumentError, match="has no spec"):
            writer.save(1, state, specs={"optimizer": _specs()["optimizer"]})
        with pytest.raises(checkpointd.InvalidArgumentError, match="not in the saved state"):
            writer.save(1, state, specs={"nope": checkpointd.spec(Net)})


def test_changed_spec_warns_against_the_previous_checkpoint(tmp_path: Path) -> None:
    with checkpointd.CheckpointWriter(str(tmp_path)) as writer:
        writer.save(1, _setup(), specs=_specs()).result(timeout=60)
    # A new writer (a restarted job) compares with the newest committed checkpoint.
    with (
        checkpointd.CheckpointWriter(str(tmp_path)) as writer,
        pytest.warns(
            checkpointd.SpecChangedWarning, match=r"'model' changed from .*Net\(8\) to .*Net\(16\)"
        ),
    ):
        writer.save(2, _setup(16), specs=_specs(16)).result(timeout=60)
    assert _manifest(tmp_path, 2).specs["model"].args == [16]


def test_async_writer_stores_specs(tmp_path: Path) -> None:
    import anyio

    async def main() -> None:
        async with checkpointd.AsyncCheckpointWriter(str(tmp_path)) as writer:
            handle = await writer.save(1, _setup(), specs=_specs())
            await handle.wait()

    anyio.run(main)
    assert _manifest(tmp_path, 1).specs["scheduler"].of == "optimizer"


def test_inspect_lists_specs(tmp_path: Path) -> None:
    with checkpointd.CheckpointWriter(str(tmp_path)) as writer:
        writer.save(1, _setup(), specs=_specs()).result(timeout=60)
    run = [sys.executable, "-m", "checkpointd", "inspect", str(tmp_path)]
    text = subprocess.run(run, capture_output=True, text=True, check=True).stdout
    assert "spec      optimizer: optimizer torch.optim.adamw.AdamW(lr=0.001) over model" in text
    data = json.loads(
        subprocess.run([*run, "--json"], capture_output=True, text=True, check=True).stdout
    )
    assert data["specs"]["scheduler"]["of"] == "optimizer"
