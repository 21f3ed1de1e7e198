"""The ``checkpointd`` command as a user runs it: in a subprocess, on local disk and on S3.

Checkpoints are written in-process (fast); every command then runs through
``python -m checkpointd`` (and once through the ``checkpointd`` script). A few
checks of pieces that need no subprocess (error lines, header-only inspect,
the progress line) call ``checkpointd.cli.main`` directly.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import checkpointd
from checkpointd.cli import main as cli
from checkpointd.read.describe import describe
from checkpointd.storage import LocalStore, open_store
from tests.conftest import Root
from tests.support.files import component_file

STEPS = (10, 20, 30)


def make_state(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    half = torch.arange(6, dtype=torch.float16)
    extra = {"epoch": step // 10, "ids": torch.arange(5), "pair": (half, half), "name": "run"}
    return {"model": model, "optimizer": optimizer, "extra": extra}


def populate(root: Root) -> dict[int, dict[str, Any]]:
    states = {}
    with checkpointd.CheckpointWriter(root.url, storage_options=root.storage_options) as writer:
        for step in STEPS:
            states[step] = make_state(step)
            writer.save(
                step,
                states[step],
                metrics={"loss": 1.0 / step, "acc": step / 100},
                metadata={"run": "cli-test", "step": step},
            ).result(timeout=60)
    return states


def option_flags(root: Root) -> list[str]:
    """--storage-option flags for the root, as a user would type them (dotted keys nest)."""
    flags: list[str] = []

    def add(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                add(f"{prefix}{key}.", item)
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            flags.extend(["--storage-option", f"{prefix[:-1]}={text}"])

    add("", root.storage_options or {})
    return flags


def run(root: Root, *args: str, check: int | None = 0) -> subprocess.CompletedProcess[str]:
    """Run ``python -m checkpointd ARGS --storage-option ...``; check the exit status."""
    command = [sys.executable, "-m", "checkpointd", *args, *option_flags(root)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    if check is not None:
        assert done.returncode == check, (
            f"{command}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
        )
    return done


@pytest.fixture
def local(local_root: Root) -> tuple[Root, dict[int, dict[str, Any]]]:
    return local_root, populate(local_root)


@pytest.fixture
def s3(s3_root: Root) -> tuple[Root, dict[int, dict[str, Any]]]:
    return s3_root, populate(s3_root)


# --- ls, inspect -------------------------------------------------------------


def test_ls_shows_each_committed_checkpoint(local: tuple[Root, Any]) -> None:
    root, _ = local
    os.makedirs(os.path.join(root.url, f"{40:012d}"))  # a save in progress: not listed
    lines = run(root, "ls", root.url).stdout.splitlines()
    assert lines[0].split() == ["step", "created", "(UTC)", "size", "metrics"]
    rows = [line.split() for line in lines[1:]]
    assert [int(r[0]) for r in rows] == list(STEPS)
    assert rows[0][-2:] == ["loss=0.1", "acc=0.1"]


def check_described(info: dict[str, Any], state: dict[str, Any], step: int) -> None:
    assert info["step"] == step
    assert info["metadata"] == {"run": "cli-test", "step": step}
    assert set(info["components"]) == {"model", "optimizer", "extra"}
    tensors = {t["name"]: t for t in info["components"]["model"]["tensors"]}
    for name, tensor in state["model"].state_dict().items():
        assert tensors[name]["dtype"] == str(tensor.dtype).removeprefix("torch.")
        assert tensors[name]["shape"] == list(tensor.shape)
        assert tensors[name]["nbytes"] == tensor.numel() * tensor.element_size()
    assert len(tensors) == len(state["model"].state_dict())
    # The aliased half tensor is stored once.
    extra = info["components"]["extra"]["tensors"]
    assert sorted(t["dtype"] for t in extra) == ["float16", "int64"]
    files = {f["path"]: f["size"] for f in info["files"]}
    assert set(info["components"]["model"]["tensor_files"]) <= set(files)
    assert sum(files.values()) == info["nbytes"]


def test_inspect_shows_components_tensors_metadata_and_files(
    local: tuple[Root, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    root, states = local
    described = json.loads(run(root, "inspect", root.url, "--step", "20", "--json").stdout)
    check_described(described, states[20], 20)

    assert cli.main(["inspect", root.url]) == 0  # the newest by default; in-process
    text = capsys.readouterr().out
    assert text.startswith(f"step 30 at {root.url}/000000000030\n")
    assert "component model: 4 tensors" in text
    assert "  0.weight  float32    [16, 8]" in text
    assert 'metadata  {"run": "cli-test", "step": 30}' in text
    assert component_file(root.url, 30, "model") in text


def test_inspect_reads_headers_not_tensor_data(tmp_path: Path) -> None:
    root = str(tmp_path / "big")
    big = {"weights": {"w": torch.randn(256, 256), "b": torch.zeros(256)}}
    with checkpointd.CheckpointWriter(root) as writer:
        writer.save(1, big).result(timeout=60)
    read: list[int] = []

    class Counting(LocalStore):
        def read_into(self, path: str, buffer: memoryview, offset: int = 0) -> None:
            read.append(len(buffer))
            super().read_into(path, buffer, offset)

    info = describe(Counting(root), None)
    assert [t["shape"] for t in info["components"]["weights"]["tensors"]] == [[256, 256], [256]]
    tensor_bytes = info["components"]["weights"]["nbytes"]
    assert tensor_bytes == (256 * 256 + 256) * 4
    assert sum(read) < 8192  # manifest + length prefix + header; not the 257 KiB of data


# --- verify --------------------------------------------------------------------


def flip_byte(root: Root, step: int, name: str) -> None:
    """Flip the last byte of a file (tensor data, past the header)."""
    store = open_store(root.url, root.storage_options)
    try:
        path = f"{step:012d}/{name}"
        data = bytearray(store.read_bytes(path))
        data[-1] ^= 0xFF
        if isinstance(store, LocalStore):
            Path(root.url, path).write_bytes(bytes(data))
        else:
            store.remove_file(path)
            store.publish(path, bytes(data))
    finally:
        store.close()


def test_verify_passes_with_progress(local: tuple[Root, Any]) -> None:
    root, _ = local
    done = run(root, "verify", root.url, "--all", "--progress")
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:3]] == ["step 10", "step 20", "step 30"]
    assert all(line.endswith(": ok") for line in lines[:3])
    assert lines[-1].startswith("verified 3 checkpoint(s)")
    assert lines[-1].endswith("all sizes and CRC32C match")
    progress = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(progress) > 3  # redrawn as it goes (tqdm, \r-separated off a terminal)
    assert all(line.startswith("verify: ") for line in progress)
    assert "100%" in progress[-1]
    assert "B/s" in progress[-1]


def test_verify_names_each_bad_file_and_fails(
    local: tuple[Root, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    root, _ = local
    flipped = component_file(root.url, 20, "model")
    flip_byte(root, 20, flipped)
    truncated = Path(root.url, f"{10:012d}", component_file(root.url, 10, "optimizer"))
    truncated.write_bytes(truncated.read_bytes()[:-3])
    bad = run(root, "verify", root.url, "--all", "--no-progress", check=1)
    lines = bad.stdout.splitlines()
    where = f"{root.url}/{20:012d}/{flipped}"
    assert any(line.startswith(f"  bad file {where}: CRC32C ") for line in lines)
    assert any(f"{truncated.name}: size" in line for line in lines)
    assert [line.endswith(": ok") for line in lines if line.startswith("step ")] == [
        False,
        False,
        True,
    ]
    assert bad.stderr.startswith("checkpointd verify: 2 failure(s); first: ")
    assert bad.stderr.count("\n") == 1

    # A damaged manifest fails --all, and the default (newest) does not skip it.
    manifest = Path(root.url, f"{30:012d}", "manifest.json")
    manifest.write_bytes(manifest.read_bytes().replace(b'"loss"', b'"LOSS"'))
    assert cli.main(["verify", root.url]) == 1
    out, err = capsys.readouterr()
    assert "manifest digest mismatch" in err
    assert cli.main(["verify", root.url, "--all"]) == 1
    out, err = capsys.readouterr()
    assert "step 30: FAILED: " in out
    assert "manifest digest mismatch" in out


# --- gc --------------------------------------------------------------------------


def test_gc_shows_then_applies_retention_and_leftover_cleanup(
    local: tuple[Root, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    root, states = local
    leftover = Path(root.url, f"{40:012d}")
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"x" * 100)  # a crashed save: no manifest
    flags = ["--keep-last", "1", "--keep-every", "20", "--older-than", "0"]

    assert cli.main(["gc", root.url, *flags]) == 0  # a dry run, in-process
    shown = capsys.readouterr().out
    assert "  delete  step         10  " in shown
    assert "  keep    step         20  (every)" in shown
    assert "  keep    step         30  (newest, last)" in shown
    assert "uncommitted 000000000040" in shown
    assert shown.rstrip().endswith("rerun with --apply to delete")
    assert [c.step for c in checkpointd.list_checkpoints(root.url)] == list(STEPS)
    assert leftover.exists()

    applied = run(root, "gc", root.url, *flags, "--apply").stdout
    assert "deleted 1 checkpoint(s) and 1 leftover(s)" in applied
    assert [c.step for c in checkpointd.list_checkpoints(root.url)] == [20, 30]
    assert sorted(os.listdir(root.url)) == [f"{20:012d}", f"{30:012d}"]
    loaded = checkpointd.load(root.url, 20)
    assert torch.equal(loaded.state["model"]["0.weight"], states[20]["model"][0].weight)

    # Without rules nothing committed goes, and the newest always stays.
    assert cli.main(["gc", root.url, "--apply"]) == 0
    assert "no rule given" in capsys.readouterr().out
    assert (
        cli.main(
            [
                "gc",
                root.url,
                "--keep-best",
                "1",
                "--best-metric",
                "acc",
                "--best-mode",
                "max",
                "--apply",
            ]
        )
        == 0
    )
    assert "keep    step         30  (newest, best)" in capsys.readouterr().out
    assert [c.step for c in checkpointd.list_checkpoints(root.url)] == [30]


# --- export ------------------------------------------------------------------------


def test_export_safetensors_and_pt(
    local: tuple[Root, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors import safe_open

    root, states = local
    target = tmp_path / "model.safetensors"
    done = run(
        root, "export", root.url, "--step", "20", "--component", "model", "--to", str(target)
    )
    assert "exported component 'model' of step 20" in done.stdout
    expected = states[20]["model"].state_dict()
    with safe_open(str(target), "pt") as f:
        assert sorted(f.keys()) == sorted(expected)
        for name, tensor in expected.items():
            assert torch.equal(f.get_tensor(name), tensor)

    extra = tmp_path / "extra.safetensors"
    assert cli.main(["export", root.url, "--component", "extra", "--to", str(extra)]) == 0
    assert "3 tensors (2 non-tensor values left out)" in capsys.readouterr().out
    with safe_open(str(extra), "pt") as f:
        assert sorted(f.keys()) == ["ids", "pair.0", "pair.1"]
        assert torch.equal(f.get_tensor("pair.1"), states[30]["extra"]["pair"][1])

    pt = tmp_path / "optimizer.pt"
    assert cli.main(["export", root.url, "--component", "optimizer", "--to", str(pt)]) == 0
    saved = torch.load(pt, weights_only=True)
    live = states[30]["optimizer"].state_dict()
    assert saved["param_groups"] == live["param_groups"]
    for index, per_param in live["state"].items():
        assert torch.equal(saved["state"][index]["momentum_buffer"], per_param["momentum_buffer"])
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp left


# --- errors -----------------------------------------------------------------------------


def test_errors_are_one_line_without_a_traceback_unless_debug(local: tuple[Root, Any]) -> None:
    root, _ = local
    missing = run(root, "inspect", root.url, "--step", "99", check=1)
    assert missing.stdout == ""
    assert (
        missing.stderr == f"checkpointd inspect: error: step 99 is not committed under {root.url}\n"
    )
    with pytest.raises(checkpointd.CheckpointNotFoundError):
        cli.main(["inspect", root.url, "--step", "99", "--debug"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ls", "{root}/nowhere", "--storage-option", "a=1"], "storage_options are only for"),
        (["verify", "{empty}"], "no committed checkpoint under"),
        (["export", "{root}", "--component", "model", "--to", "m.npz"], "must end in .safetensors"),
        (["export", "{root}", "--component", "nope", "--to", "x.pt"], "has no component 'nope'"),
        (["gc", "{root}", "--keep-best", "2"], "keep_best needs best_metric"),
        (["gc", "{root}", "--keep-last", "0"], "keep_last must be a positive int"),
    ],
)
def test_error_lines(
    local: tuple[Root, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    root, _ = local
    (tmp_path / "empty").mkdir()
    argv = [a.format(root=root.url, empty=tmp_path / "empty") for a in argv]
    assert cli.main(argv) == 1
    out, err = capsys.readouterr()
    assert out == "" or "retention" not in out
    assert err.count("\n") == 1
    assert err.startswith(f"checkpointd {argv[0]}: error: ")
    assert message in err


def test_the_checkpointd_script_runs_too(local: tuple[Root, Any]) -> None:
    root, _ = local
    script = shutil.which("checkpointd", path=os.path.dirname(sys.executable))
    assert script is not None, "the console script is not installed next to the interpreter"
    done = subprocess.run(
        [script, "ls", root.url, "--json"], capture_output=True, text=True, timeout=120, check=True
    )
    listed = json.loads(done.stdout)
    infos = checkpointd.list_checkpoints(root.url)
    assert [row["step"] for row in listed] == list(STEPS)
    for row, info in zip(listed, infos, strict=True):
        assert row["nbytes"] == info.nbytes > 0
        assert row["metrics"] == {"loss": 1.0 / info.step, "acc": info.step / 100}
        assert row["created_at"] == info.created_at.isoformat().replace("+00:00", "Z")


# --- S3 -------------------------------------------------------------------------------------


def test_every_command_on_s3(
    s3: tuple[Root, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ls, verify and gc in subprocesses; inspect and export in-process (same argv), since
    each subprocess costs seconds of imports."""
    root, states = s3
    listed = json.loads(run(root, "ls", root.url, "--json").stdout)
    assert [row["step"] for row in listed] == list(STEPS)

    assert cli.main(["inspect", root.url, "--step", "10", "--json", *option_flags(root)]) == 0
    check_described(json.loads(capsys.readouterr().out), states[10], 10)

    flipped = component_file(root.url, 20, "optimizer", storage_options=root.storage_options)
    flip_byte(root, 20, flipped)
    bad = run(root, "verify", root.url, "--all", check=1)
    assert f"bad file {root.url}/{20:012d}/{flipped}: CRC32C" in bad.stdout
    steps = [line for line in bad.stdout.splitlines() if line.startswith("step")]
    assert [line.endswith(": ok") for line in steps] == [True, False, True]

    target = tmp_path / "m.pt"
    argv = ["export", root.url, "--component", "model", "--to", str(target), *option_flags(root)]
    assert cli.main(argv) == 0
    saved = torch.load(target, weights_only=True)
    for name, tensor in states[30]["model"].state_dict().items():
        assert torch.equal(saved[name], tensor)

    applied = run(root, "gc", root.url, "--keep-last", "1", "--apply").stdout
    assert "deleted 2 checkpoint(s)" in applied
    remaining = checkpointd.list_checkpoints(root.url, storage_options=root.storage_options)
    assert [c.step for c in remaining] == [30]


# --- pieces ---------------------------------------------------------------------------------


def test_progress_bar_shows_bytes_rate_and_time_left() -> None:
    stream = io.StringIO()
    with cli.progress_bar(8 * 2**20, "always", stream) as bar:
        bar.update(4 * 2**20)
        line = stream.getvalue().split("\r")[-1]
        assert line.startswith("verify:  50%|")
        assert "4.00M/8.00M" in line
        assert "B/s]" in line
    quiet = io.StringIO()
    with cli.progress_bar(100, "auto", quiet) as auto:
        auto.update(50)  # well under the 1 s delay: nothing shown for short work
        cli.say(auto, "step 1: ok")  # a result line must not draw the waiting bar
    assert quiet.getvalue() == ""
    never = io.StringIO()
    with cli.progress_bar(100, "never", never) as off:
        off.update(100)
    assert never.getvalue() == ""


def test_storage_options_nest_and_parse_json() -> None:
    args = cli.build_parser().parse_args(
        [
            "ls",
            "s3://b/r",
            "--storage-option",
            "key=abc",
            "--storage-option",
            "client_kwargs.endpoint_url=http://127.0.0.1:9000",
            "--storage-option",
            "skip_instance_cache=true",
            "--storage-option",
            'config_kwargs.retries={"max_attempts": 2}',
        ]
    )
    assert cli.storage_options(args) == {
        "key": "abc",
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"},
        "skip_instance_cache": True,
        "config_kwargs": {"retries": {"max_attempts": 2}},
    }


def test_export_writes_tied_tensors_once_per_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """save_file refuses two names over one memory: an aliased tensor is copied per name."""
    from safetensors.torch import load_file

    root = str(tmp_path / "ckpt")
    shared = torch.arange(6.0)
    state = {"model": {"embed": shared, "head": shared, "bias": torch.ones(2), "n": 3}}
    with checkpointd.CheckpointWriter(root) as writer:
        writer.save(1, state).result(timeout=60)
    target = str(tmp_path / "out.safetensors")
    assert cli.main(["export", root, "--component", "model", "--to", target]) == 0
    assert "3 tensors (1 non-tensor values left out)" in capsys.readouterr().out
    saved = load_file(target)
    assert sorted(saved) == ["bias", "embed", "head"]
    assert torch.equal(saved["embed"], shared)
    assert torch.equal(saved["head"], shared)


def test_help_says_what_export_writes(capsys: pytest.CaptureFixture[str]) -> None:
    """`checkpointd --help` named only the file formats of export (issue 19)."""
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    export = text[text.index("export ") : text.index(" import ")]
    for word in (".safetensors", ".pt", "Hugging Face", "DCP"):
        assert word in export, export
