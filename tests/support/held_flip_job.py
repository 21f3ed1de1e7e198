"""One rank of tests/support/shard_job.py whose restore from its service's memory tier
meets a write into the service's segment between the check pass and the landing.

    python -m tests.support.held_flip_job ACTION MODE ROOT OUT RANK WORLD PORT

As shard_job (with CHECKPOINTD_TEST_SERVICES), and: right after this rank's first
``Boxes.check`` (the model's direct local shards), one byte in the middle of the first
contiguous part of those shards is flipped in the held segment of this rank's service,
whose pid is the RANK-th of CHECKPOINTD_TEST_SERVICE_PIDS, written through its memfd in
/proc as a stray writer would. OUT/flippedR.json: how many of the service's memfds
were written into.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from checkpointd.read import boxes
from tests.support import shard_job
from tests.support.service import held_files


def _flip_in_segments(pid: int, at: int) -> int:
    """Flip byte ``at`` of each of service ``pid``'s checkpointd memfds long enough (the
    held segment among them; the others are not read); how many were flipped."""
    flipped: set[int] = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if not os.readlink(fd).startswith("/memfd:checkpointd-"):
                continue
            memory = open(fd, "r+b")  # noqa: SIM115 - closed below; the open may fail
        except FileNotFoundError:
            continue
        with memory:
            info = os.fstat(memory.fileno())
            if info.st_ino in flipped or info.st_size < at + 1:
                continue
            flipped.add(info.st_ino)
            memory.seek(at)
            byte = memory.read(1)[0]
            memory.seek(at)
            memory.write(bytes([byte ^ 0xFF]))
    return len(flipped)


def main() -> None:
    action, _, root, out, rank_s = sys.argv[1:6]
    rank = int(rank_s)
    socket = os.environ["CHECKPOINTD_TEST_SERVICES"].split(",")[rank]
    pid = int(os.environ["CHECKPOINTD_TEST_SERVICE_PIDS"].split(",")[rank])
    flipped: list[int] = []
    checked = boxes.Boxes.check

    def then_flip(self: boxes.Boxes) -> None:
        checked(self)
        if flipped or action != "restore":
            return
        pieces = [p for item in self.boxes.values() for p in item.parts if p.contiguous]
        begin, end, _ = pieces[0].contiguous  # type: ignore[misc]
        at = pieces[0].shard.begin + (begin + end) // 2
        (held,) = [f for f in held_files(socket, root, 1) if f.path == pieces[0].shard.file]
        assert at >= len(held.head)
        flipped.append(_flip_in_segments(pid, held.offset + at - len(held.head)))

    boxes.Boxes.check = then_flip  # type: ignore[method-assign]
    shard_job.main()
    with open(os.path.join(out, f"flipped{rank}.json"), "w") as f:
        json.dump(sum(flipped), f)


if __name__ == "__main__":
    main()
