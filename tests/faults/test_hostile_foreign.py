"""Damaged or hostile foreign sources given to ``checkpointd import`` (issue 19).

Each source is refused with a typed error from the library (never a raw
RuntimeError, SafetensorError, AttributeError or torch's CheckpointException,
which ``except Exception`` misses) and with one line on stderr from the CLI.
A DCP folder is never read outside itself: ``relative_path`` values that climb
out or are absolute, symlinks out of the folder and FIFOs are refused.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import checkpointd
from checkpointd.cli.main import main
from checkpointd.interop.foreign import import_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _safetensors(path: Path, header: dict[str, Any], data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _truncated_pt(tmp: Path) -> Path:
    torch.save({"w": torch.randn(64, 64)}, tmp / "w.pt")
    data = (tmp / "w.pt").read_bytes()
    (tmp / "w.pt").write_bytes(data[: len(data) // 2])
    return tmp / "w.pt"


def _overlapping(tmp: Path) -> Path:
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    _safetensors(tmp / "w.safetensors", header, bytes(12))
    return tmp / "w.safetensors"


def _unknown_dtype(tmp: Path) -> Path:
    _safetensors(
        tmp / "w.safetensors",
        {"a": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}},
        bytes(8),
    )
    return tmp / "w.safetensors"


def _huge_header(tmp: Path) -> Path:
    (tmp / "w.safetensors").write_bytes(struct.pack("<Q", 2**40) + b"{}")
    return tmp / "w.safetensors"


def _index_is_a_list(tmp: Path) -> Path:
    (tmp / "hf").mkdir()
    save_file({"a": torch.zeros(2)}, str(tmp / "hf" / "model-00001-of-00001.safetensors"))
    (tmp / "hf" / "model.safetensors.index.json").write_text("[1, 2]")
    return tmp / "hf"


def _index_not_json(tmp: Path) -> Path:
    (tmp / "hf").mkdir()
    (tmp / "hf" / "model.safetensors.index.json").write_bytes(b"\xff{not json")
    return tmp / "hf"


def _index_names_a_missing_shard(tmp: Path) -> Path:
    (tmp / "hf").mkdir()
    index = {"weight_map": {"a": "model-00001-of-00001.safetensors"}}
    (tmp / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    return tmp / "hf"


def _dcp(tmp: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {"w": torch.arange(6.0)}}, checkpoint_id=str(tmp / "dcp"), no_dist=True)
    return tmp / "dcp"


def _data_file(folder: Path) -> Path:
    (found,) = [p for p in folder.iterdir() if p.suffix == ".distcp"]
    return found


def _dcp_missing_data(tmp: Path) -> Path:
    folder = _dcp(tmp)
    _data_file(folder).unlink()
    return folder


def _dcp_truncated_data(tmp: Path) -> Path:
    folder = _dcp(tmp)
    data = _data_file(folder)
    data.write_bytes(data.read_bytes()[:10])
    return folder


def _dcp_zeroed_data(tmp: Path) -> Path:
    """The right size, the wrong bytes: torch's own reader fails (a CheckpointException)."""
    folder = _dcp(tmp)
    data = _data_file(folder)
    data.write_bytes(bytes(data.stat().st_size))
    return folder


DAMAGED: dict[str, Callable[[Path], Path]] = {
    "truncated-pt": _truncated_pt,
    "safetensors-overlapping-offsets": _overlapping,
    "safetensors-unknown-dtype": _unknown_dtype,
    "safetensors-1TiB-header": _huge_header,
    "hf-index-is-a-list": _index_is_a_list,
    "hf-index-not-json": _index_not_json,
    "hf-missing-shard": _index_names_a_missing_shard,
    "dcp-missing-data-file": _dcp_missing_data,
    "dcp-truncated-data-file": _dcp_truncated_data,
    "dcp-zeroed-data-file": _dcp_zeroed_data,
}


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_damaged_sources_are_corrupt_checkpoint_errors(tmp_path: Path, case: str) -> None:
    source = DAMAGED[case](tmp_path)
    with pytest.raises(checkpointd.CorruptCheckpointError) as caught:
        import_checkpoint(str(source), str(tmp_path / "root"))
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "root").exists() or not os.listdir(tmp_path / "root")


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_cli_import_of_damaged_sources_prints_one_line(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    source = DAMAGED[case](tmp_path)
    assert main(["import", str(source), str(tmp_path / "root")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("checkpointd import: error: "), err
    assert err.count("\n") == 1, err
    assert "Traceback" not in err


def test_cli_import_of_a_dcp_folder_missing_its_data_in_a_real_process(tmp_path: Path) -> None:
    """torch's CheckpointException is a BaseException: it escaped ``except Exception``."""
    source = _dcp_missing_data(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "checkpointd", "import", str(source), str(tmp_path / "root")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    lines = [
        line for line in done.stderr.splitlines() if "torch.distributed is disabled" not in line
    ]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("checkpointd import: error: "), done.stderr


def _point_data_at(folder: Path, where: str) -> None:
    """Rewrite every ``relative_path`` of the folder's ``.metadata`` (our own file)."""
    path = folder / ".metadata"
    with open(path, "rb") as f:
        metadata = pickle.load(f)
    for info in metadata.storage_data.values():
        info.relative_path = where
    path.write_bytes(pickle.dumps(metadata))


def _outside_copy(tmp: Path, folder: Path) -> Path:
    outside = tmp / "outside.distcp"
    outside.write_bytes(_data_file(folder).read_bytes())  # readable, valid data
    return outside


def _climbs_out(tmp: Path) -> Path:
    folder = _dcp(tmp)
    _outside_copy(tmp, folder)
    _point_data_at(folder, "../outside.distcp")
    return folder


def _absolute(tmp: Path) -> Path:
    folder = _dcp(tmp)
    _point_data_at(folder, str(_outside_copy(tmp, folder)))
    return folder


def _symlink_out(tmp: Path) -> Path:
    folder = _dcp(tmp)
    outside = _outside_copy(tmp, folder)
    data = _data_file(folder)
    data.unlink()
    data.symlink_to(outside)
    return folder


def _metadata_symlink_out(tmp: Path) -> Path:
    folder = _dcp(tmp)
    (tmp / "outside.metadata").write_bytes((folder / ".metadata").read_bytes())
    (folder / ".metadata").unlink()
    (folder / ".metadata").symlink_to(tmp / "outside.metadata")
    return folder


def _fifo(tmp: Path) -> Path:
    """The data file is a FIFO; a thread feeds it the real bytes so nothing hangs."""
    folder = _dcp(tmp)
    data = _data_file(folder)
    content = data.read_bytes()
    data.unlink()
    os.mkfifo(data)

    def feed() -> None:
        # open blocks until a reader opens the FIFO; the test's own release closes it
        # unread, so a broken pipe here is the expected end, not a failure
        try:
            with open(data, "wb") as f:
                f.write(content)
        except OSError:
            return

    threading.Thread(target=feed, daemon=True).start()
    return folder


OUTSIDE: dict[str, Callable[[Path], Path]] = {
    "relative-path-climbs-out": _climbs_out,
    "relative-path-absolute": _absolute,
    "data-file-symlink-out": _symlink_out,
    "metadata-symlink-out": _metadata_symlink_out,
    "data-file-fifo": _fifo,
}


@pytest.mark.parametrize("case", sorted(OUTSIDE))
def test_dcp_import_never_reads_outside_its_folder(tmp_path: Path, case: str) -> None:
    source = OUTSIDE[case](tmp_path)
    with pytest.raises(checkpointd.CorruptCheckpointError, match="DCP"):
        import_checkpoint(str(source), str(tmp_path / "root"))
    assert not (tmp_path / "root").exists() or not os.listdir(tmp_path / "root")
    for fifo in (p for p in source.iterdir() if p.is_fifo()):  # release the feeding thread
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        os.close(fd)


def test_a_source_that_does_not_exist_is_typed(tmp_path: Path) -> None:
    with pytest.raises(checkpointd.StorageNotFoundError):
        import_checkpoint(str(tmp_path / "nothing.pt"), str(tmp_path / "root"))
