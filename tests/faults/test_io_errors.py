"""I/O errors during a save: ENOSPC, EIO on write and fsync, EACCES, EFBIG (RLIMIT_FSIZE).

Each fails the save with a typed error surfaced at ``wait()``, leaves no temp
file, leaves the previous checkpoint byte-identical and publishes nothing; the
same writer then saves the next step. A failed fsync is never retried.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import checkpointd
from checkpointd import tunables
from checkpointd.errors import StorageError, StorageFullError, StoragePermissionError
from tests.faults.helpers import check_intact, make_state
from tests.support.faults import ErrnoRule, FaultyOS, temp_files, tree_files

STEP2 = "000000000002"

CASES = [
    # (op, errno, path fragment, nth matching call, expected error type)
    ("mkdir", errno.ENOSPC, STEP2, 1, StorageFullError),
    ("create", errno.EACCES, ".safetensors", 1, StoragePermissionError),
    ("write", errno.ENOSPC, ".safetensors", 1, StorageFullError),
    ("write", errno.EIO, ".msgpack", 1, StorageError),
    ("fsync", errno.EIO, ".safetensors", 1, StorageError),
    ("fsync", errno.EIO, "manifest.json", 1, StorageError),
    ("replace", errno.EIO, ".safetensors", 1, StorageError),
    ("link", errno.ENOSPC, "manifest.json", 1, StorageFullError),
    # The step folder's fsyncs: after the file renames, after the manifest link.
    ("fsync_dir", errno.EIO, STEP2, 1, StorageError),
    ("fsync_dir", errno.EIO, STEP2, 2, StorageError),
]


@pytest.mark.parametrize(
    ("op", "code", "match", "nth", "kind"),
    CASES,
    ids=[f"{c[0]}-{errno.errorcode[c[1]]}-{c[2]}-{c[3]}" for c in CASES],
)
def test_io_error_fails_save_cleanly(  # noqa: PLR0917 - one parameter per case column
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    op: str,
    code: int,
    match: str,
    nth: int,
    kind: type[StorageError],
) -> None:
    root = str(tmp_path / "ckpt")
    expected = {1: make_state(1), 3: make_state(3)}
    with checkpointd.CheckpointWriter(root) as writer:
        writer.save(1, expected[1]).result()
    before = tree_files(root)

    faulty = FaultyOS(rules=[ErrnoRule(op, code, match, nth)]).install(monkeypatch)
    with checkpointd.CheckpointWriter(root) as writer:
        writer.save(2, make_state(2))
        with pytest.raises(kind) as failure:
            writer.wait()
        assert failure.value.errno == code
        assert any(entry[0] == f"{op}!" for entry in faulty.log), "the fault never fired"

        after = tree_files(root)
        assert temp_files(root) == []
        assert {p: b for p, b in after.items() if not p.startswith(STEP2)} == before
        assert not os.path.exists(f"{root}/{STEP2}/manifest.json")
        assert [i.step for i in checkpointd.list_checkpoints(root)] == [1]
        if op == "fsync":
            failed = next(path for o, path in faulty.log if o == "fsync!")
            later = faulty.log[faulty.log.index(("fsync!", failed)) + 1 :]
            reused = [o for o, path in later if path == failed and o != "unlink"]
            assert reused == [], f"{failed} was {reused} after its fsync failed"

        writer.save(3, expected[3]).result()  # the writer keeps working
    monkeypatch.undo()
    assert check_intact(root, expected) == [1, 3]


_FSIZE_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys, torch, checkpointd
    root = sys.argv[1]
    out = {}
    with checkpointd.CheckpointWriter(root) as writer:
        writer.save(1, {"w": torch.ones(100)}).result()
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        writer.save(2, {"w": torch.ones(2**20)})
        try:
            writer.wait()
        except checkpointd.CheckpointError as exc:
            out["error"] = type(exc).__name__
            out["errno"] = exc.errno
        writer.save(3, {"w": torch.full((100,), 3.0)}).result()
    print(json.dumps(out))
    """
)


def test_rlimit_fsize_gives_storage_full(tmp_path: Path) -> None:
    """A real file size limit: write fails with EFBIG (Python ignores SIGXFSZ)."""
    root = str(tmp_path / "ckpt")
    run = subprocess.run(
        [sys.executable, "-c", _FSIZE_SCRIPT, root],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out == {"error": "StorageFullError", "errno": errno.EFBIG}
    assert temp_files(root) == []
    assert [i.step for i in checkpointd.list_checkpoints(root)] == [1, 3]
    assert float(checkpointd.load(root).state["w"][0]) == 3.0


DIRECT_SIZE = (
    tunables.DIRECT_MIN_BYTES // 16
)  # make_state's (size, 4) float32 tensor: O_DIRECT-sized


@pytest.mark.parametrize(
    ("code", "kind"),
    [(errno.ENOSPC, StorageFullError), (errno.EIO, StorageError)],
    ids=["ENOSPC", "EIO"],
)
def test_direct_write_error_fails_save_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, kind: type[StorageError]
) -> None:
    """ENOSPC/EIO on an O_DIRECT write: a typed error, no temp file, nothing published."""
    root = str(tmp_path / "ckpt")
    expected = {1: make_state(1, DIRECT_SIZE), 3: make_state(3, DIRECT_SIZE)}
    with checkpointd.CheckpointWriter(root) as writer:
        writer.save(1, expected[1]).result()
    before = tree_files(root)

    rule = ErrnoRule("write_direct", code, ".safetensors")
    faulty = FaultyOS(rules=[rule]).install(monkeypatch)
    with checkpointd.CheckpointWriter(root) as writer:
        writer.save(2, make_state(2, DIRECT_SIZE))
        with pytest.raises(kind) as failure:
            writer.wait()
        assert failure.value.errno == code
        assert any(o == "write_direct!" for o, _ in faulty.log), "the fault never fired"
        assert temp_files(root) == []
        assert {p: b for p, b in tree_files(root).items() if not p.startswith(STEP2)} == before
        assert [i.step for i in checkpointd.list_checkpoints(root)] == [1]
        writer.save(3, expected[3]).result()  # the writer keeps working, direct I/O included
    assert sum(o == "write_direct" for o, _ in faulty.log) > 0
    monkeypatch.undo()
    assert check_intact(root, expected) == [1, 3]


def test_direct_write_refused_midway_falls_back_to_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EINVAL on an O_DIRECT write (a device wanting larger alignment): the save
    finishes through the buffered path, bit-exact."""
    root = str(tmp_path / "ckpt")
    expected = {2: make_state(2, DIRECT_SIZE)}
    faulty = FaultyOS(rules=[ErrnoRule("write_direct", errno.EINVAL, ".safetensors")])
    faulty.install(monkeypatch)
    with checkpointd.CheckpointWriter(root) as writer:
        writer.save(2, expected[2]).result()
    assert [o for o, _ in faulty.log if o.startswith("write_direct")] == ["write_direct!"]
    monkeypatch.undo()
    assert check_intact(root, expected) == [2]
