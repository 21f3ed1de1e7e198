"""Hostile specs in a checkpoint: refused before any import, never run.

Each test rewrites a good checkpoint's manifest (with a valid digest) so its
specs name something hostile, then calls build().
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

import checkpointd
from checkpointd.format.manifest import decode_manifest, encode_manifest, step_dirname
from checkpointd.rebuild.build import BUILTIN_ALLOW
from tests.support.specmodels import Net

ALLOW = ("tests.support.specmodels", *BUILTIN_ALLOW)


def _saved(root: Path) -> Path:
    model = Net(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    specs = {
        "model": checkpointd.spec(Net, 4),
        "optimizer": checkpointd.spec(torch.optim.SGD, lr=0.1),
    }
    with checkpointd.CheckpointWriter(str(root)) as writer:
        writer.save(1, {"model": model, "optimizer": opt}, specs=specs).result(timeout=60)
    return root / step_dirname(1) / "manifest.json"


def _rewrite(path: Path, name: str, **changes: Any) -> None:
    manifest = decode_manifest(path.read_bytes())
    specs = dict(manifest.specs)
    specs[name] = msgspec.structs.replace(specs[name], **changes)
    path.write_bytes(encode_manifest(msgspec.structs.replace(manifest, specs=specs)))


def _raw_rewrite(path: Path, name: str, raw: dict[str, Any]) -> None:
    """Put any JSON in place of a spec (bypasses the typed encoder; digest still valid)."""
    from checkpointd.format.checksum import crc32c

    data = msgspec.json.decode(path.read_bytes())
    del data["manifest_crc32c"]
    data["specs"][name] = raw
    body = msgspec.json.encode(data)
    path.write_bytes(body[:-1] + b',"manifest_crc32c":"%08x"}\n' % crc32c(body))


@pytest.mark.parametrize(
    ("module", "qualname", "allow"),
    [
        ("os", "system", ALLOW),
        ("os", "system", ("os",)),  # denied even when allowed
        ("builtins", "eval", ("builtins.",)),
        ("subprocess", "run", ("subprocess",)),
        ("subprocess", "Popen", ALLOW),
        ("posix", "system", ("posix",)),
        ("torch.hub", "load", ("torch.",)),
        ("torch.utils.cpp_extension", "load", ("torch.",)),
        ("tests.support.specprobe", "Probe", ALLOW),  # outside allow: never imported
        ("tests.support.specprobe", "Probe", ("tests.support.spec",)),  # prefix is per part
        ("tests.support.specprobe", "Probe", ()),  # nothing allowed by default
    ],
)
def test_hostile_paths_are_refused_before_import(
    tmp_path: Path,
    module: str,
    qualname: str,
    allow: tuple[str, ...],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    marker = tmp_path / "ran"
    monkeypatch.setenv("CHECKPOINTD_SPECPROBE", str(marker))
    sys.modules.pop("tests.support.specprobe", None)
    path = _saved(tmp_path / "ckpt")
    _rewrite(path, "model", module=module, qualname=qualname, args=[f"touch {marker}"])
    with pytest.raises(checkpointd.UnsafeSpecError, match="nothing was imported"):
        checkpointd.build(str(tmp_path / "ckpt"), allow=allow)
    assert not marker.exists()
    assert "tests.support.specprobe" not in sys.modules


def test_a_later_hostile_spec_stops_the_earlier_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model is allowed, the optimizer is not: nothing at all is imported or built."""
    marker = tmp_path / "ran"
    monkeypatch.setenv("CHECKPOINTD_SPECPROBE", str(marker))
    sys.modules.pop("tests.support.specprobe", None)
    path = _saved(tmp_path / "ckpt")
    _rewrite(path, "model", module="tests.support.specprobe", qualname="Probe", args=[])
    _rewrite(path, "optimizer", module="os", qualname="system")
    with pytest.raises(checkpointd.UnsafeSpecError, match="'optimizer'"):
        checkpointd.build(str(tmp_path / "ckpt"), allow=(*ALLOW, "tests.support.specprobe"))
    assert not marker.exists()


@pytest.mark.parametrize(
    ("module", "qualname"),
    [
        ("../../etc", "passwd"),
        ("tests/support/specmodels", "Net"),
        (".specmodels", "Net"),
        ("tests.support.specmodels", "Net.__init__.__globals__"),
        ("tests.support.specmodels", "Net.__class__"),
        ("__main__", "Net"),
        ("tests.support.specmodels", "Net\x00"),
        ("tests.support.specmodels", "a" * 300),
        ("", "Net"),
    ],
)
def test_path_like_names_are_refused(tmp_path: Path, module: str, qualname: str) -> None:
    path = _saved(tmp_path / "ckpt")
    _rewrite(path, "model", module=module, qualname=qualname)
    with pytest.raises(checkpointd.UnsafeSpecError):
        checkpointd.build(str(tmp_path / "ckpt"), allow=(*ALLOW, "", ".", "..", "__main__"))


@pytest.mark.parametrize(
    "qualname",
    ["torch", "SENTINEL", "SENTINEL.append", "Any", "nn.Linear"],
)
def test_aliases_and_non_callables_in_an_allowed_module_are_refused(
    tmp_path: Path, qualname: str
) -> None:
    """Walking through an imported module or an alias would escape the allow list."""
    path = _saved(tmp_path / "ckpt")
    _rewrite(path, "model", qualname=qualname)
    with pytest.raises(checkpointd.UnsafeSpecError, match="class or function"):
        checkpointd.build(str(tmp_path / "ckpt"), allow=ALLOW)


@pytest.mark.parametrize(
    "raw",
    [
        {"module": "os", "qualname": "system", "kind": "model", "args": "rm -rf /"},
        {"module": "os", "qualname": ["system"], "kind": "model"},
        {
            "module": "os",
            "qualname": "system",
            "kind": "model",
            "args": [{"__reduce__": 1}],
            "params": 3,
        },
        {"qualname": "Net", "kind": "model"},
    ],
)
def test_non_json_spec_fields_are_corrupt(tmp_path: Path, raw: dict[str, Any]) -> None:
    path = _saved(tmp_path / "ckpt")
    _raw_rewrite(path, "model", raw)
    with pytest.raises(checkpointd.CorruptCheckpointError):
        checkpointd.build(str(tmp_path / "ckpt"), step=1, allow=ALLOW)


def test_inconsistent_kinds_and_associations_are_corrupt(tmp_path: Path) -> None:
    path = _saved(tmp_path / "ckpt")
    _rewrite(path, "optimizer", of="nowhere")
    with pytest.raises(checkpointd.CorruptCheckpointError, match="inconsistent"):
        checkpointd.build(str(tmp_path / "ckpt"), allow=ALLOW)
    _rewrite(path, "optimizer", of="model", kind="shell")
    with pytest.raises(checkpointd.CorruptCheckpointError, match="inconsistent"):
        checkpointd.build(str(tmp_path / "ckpt"), allow=ALLOW)


def test_huge_argument_trees_are_refused(tmp_path: Path) -> None:
    path = _saved(tmp_path / "ckpt")
    deep: Any = 0
    for _ in range(100):
        deep = [deep]
    with pytest.raises(checkpointd.UnsupportedValueError, match="specs is nested deeper"):
        _rewrite(path, "model", args=[deep])  # the writer's encoder refuses it too
    _raw_rewrite(
        path, "model", {"module": "os", "qualname": "system", "kind": "model", "args": [deep]}
    )
    with pytest.raises(checkpointd.CorruptCheckpointError, match="nested deeper"):
        checkpointd.build(str(tmp_path / "ckpt"), step=1, allow=ALLOW)
    wide = ["x" * 1000] * 100  # 100 KB of arguments: more than a spec may hold
    _raw_rewrite(
        path, "model", {"module": "os", "qualname": "system", "kind": "model", "args": wide}
    )
    with pytest.raises(checkpointd.CorruptCheckpointError, match="more than 65536"):
        checkpointd.build(str(tmp_path / "ckpt"), step=1, allow=ALLOW)


def test_allow_must_be_a_sequence(tmp_path: Path) -> None:
    _saved(tmp_path / "ckpt")
    with pytest.raises(checkpointd.InvalidArgumentError):
        checkpointd.build(str(tmp_path / "ckpt"), allow="tests.")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("module", "qualname", "allow"),
    [
        # A plain function under torch.nn. whose body is importlib.import_module(arg).
        ("torch.nn.attention._fa3", "_fa3_import_module", ALLOW),
        ("torch.nn.attention._fa3", "_fa3_import_module", ("torch.nn.", "torch.optim.")),
        ("torch.nn.init", "xavier_uniform_", ALLOW),
        ("torch.nn.functional", "relu", ALLOW),
        ("torch.nn.modules.module", "register_module_forward_hook", ALLOW),
        ("torch.optim.optimizer", "register_optimizer_step_pre_hook", ALLOW),
        ("torch.optim.lr_scheduler", "LRScheduler.step", ALLOW),  # below an allowed class
        ("tests.support.specprobe", "_Private", ("tests.support.specprobe", *ALLOW)),
        ("tests.support.specprobe", "_Private", ("tests.support.specprobe._Private", *ALLOW)),
    ],
)
def test_non_classes_and_private_paths_under_allowed_prefixes_are_refused(
    tmp_path: Path,
    module: str,
    qualname: str,
    allow: tuple[str, ...],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """BUILTIN_ALLOW names classes, not prefixes; no allow admits a private part (issue 19)."""
    marker = tmp_path / "ran"
    monkeypatch.setenv("CHECKPOINTD_SPECPROBE", str(marker))
    sys.modules.pop("tests.support.specprobe", None)
    path = _saved(tmp_path / "ckpt")
    _rewrite(path, "model", module=module, qualname=qualname, args=["tests.support.specprobe"])
    with pytest.raises(checkpointd.UnsafeSpecError, match="nothing was imported"):
        checkpointd.build(str(tmp_path / "ckpt"), allow=allow)
    assert not marker.exists()
    assert "tests.support.specprobe" not in sys.modules


def test_spec_refuses_private_paths() -> None:
    """What build() would never import is refused when the spec is made, not at build."""
    from torch.nn.attention import _fa3

    with pytest.raises(checkpointd.InvalidArgumentError, match="private name '_fa3'"):
        checkpointd.spec(_fa3._fa3_import_module, "tests.support.specprobe")  # noqa: SLF001 - the point: a private name is refused
