"""Child processes for the service's fault tests: a trainer that saves through a service,
and a service whose writes are held (a save stays in flight until a file appears).

``python -m tests.support.service_jobs trainer SOCKET ROOT STEPS [hang-in-copy | overlapped]``
prints ``returned N`` (flushed) once ``save(N)`` has returned; with ``hang-in-copy``
it stops for good right after the service handed it a segment (as if the copy into
shared memory were under way) and prints ``copying``; with ``overlapped`` it saves
with ``staging="overlapped"`` and prints ``staged N`` once save N is staged.
``python -m tests.support.service_jobs held-serve GATE METHOD -- SERVE-ARGS`` runs
``checkpointd serve`` with every call of ``LocalStore.METHOD`` (``make_dir``: a save's
first storage call; ``sync_dir``: after its files are written, before the manifest)
waiting for file GATE (``peer_push``: every replica pushed to a peer waits instead;
``METHOD:FOLDER``: only the calls of roots under FOLDER wait, the others' go on);
$CHECKPOINTD_TEST_TUNABLES (JSON) sets tunables in the service first.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch


def expected_state(step: int) -> dict[str, torch.Tensor]:
    """The state a trainer saves at ``step`` (deterministic, so a test can recompute it)."""
    generator = torch.Generator().manual_seed(step)
    return {
        "weights": torch.randn(256, 256, generator=generator),
        "step": torch.full((3,), step, dtype=torch.int64),
    }


def trainer(socket: str, root: str, steps: int, mode: str | None) -> None:
    import checkpointd
    from checkpointd.write.capture import StagingBuffer

    if mode == "overlapped":
        overlapped_trainer(socket, root, steps)
        return
    if mode == "hang-in-copy":
        real = StagingBuffer.reserve

        def reserve(self: StagingBuffer, nbytes: int, *, pinned: bool) -> torch.Tensor:
            real(self, nbytes, pinned=pinned)  # the service has handed out the segment
            print("copying", flush=True)
            while True:
                time.sleep(1)

        StagingBuffer.reserve = reserve  # type: ignore[method-assign]
    with checkpointd.CheckpointWriter(root, service=socket) as writer:
        for step in range(steps):
            writer.save(step, {"model": expected_state(step)})
            print(f"returned {step}", flush=True)
        writer.wait()
    from checkpointd.daemon.client.client import status

    print(f"service pid {status(socket).pid}", flush=True)


def overlapped_trainer(socket: str, root: str, steps: int) -> None:
    """Saves ``expected_state(step)`` with ``staging="overlapped"``, its weights an
    optimizer's parameter (so copied in the background); prints ``staged N`` once
    save N is staged, then changes the weights for the next step."""
    import checkpointd

    weights = torch.nn.Parameter(torch.zeros(256, 256))
    optimizer = torch.optim.SGD([weights], lr=0.1)
    with checkpointd.CheckpointWriter(root, service=socket, staging="overlapped") as writer:
        for step in range(steps):
            expected = expected_state(step)
            with torch.no_grad():
                weights.copy_(expected["weights"])
            state = {
                "model": {"weights": weights, "step": expected["step"]},
                "optimizer": optimizer,
            }
            writer.save(step, state).wait_staged()
            print(f"staged {step}", flush=True)
        writer.wait()


def held_serve(gate: str, method: str, serve_args: list[str]) -> None:
    from checkpointd import tunables
    from checkpointd.cli.main import main
    from checkpointd.storage import LocalStore

    for name, value in json.loads(os.environ.get("CHECKPOINTD_TEST_TUNABLES", "{}")).items():
        setattr(tunables, name, value)
    if method == "peer_push":
        held_pushes(gate)
        sys.exit(main(["serve", *serve_args]))
    method, _, under = method.partition(":")
    real = getattr(LocalStore, method)

    def held(self: LocalStore, path: str) -> None:
        while self.root.startswith(under) and not os.path.exists(gate):
            time.sleep(0.01)
        real(self, path)

    setattr(LocalStore, method, held)
    sys.exit(main(["serve", *serve_args]))


def held_pushes(gate: str) -> None:
    """Every replica the service pushes to a peer waits (on the event loop, asleep) until
    file ``gate`` exists."""
    import anyio

    from checkpointd.daemon.server.peerlink import PeerPort

    real = PeerPort._push  # noqa: SLF001 - the one step a test holds back

    async def held(self: PeerPort, *args: Any) -> None:
        while not await anyio.Path(gate).exists():  # noqa: ASYNC110 - a file is the gate
            await anyio.sleep(0.01)
        await real(self, *args)

    PeerPort._push = held  # type: ignore[method-assign,assignment]  # noqa: SLF001


if __name__ == "__main__":
    if sys.argv[1] == "trainer":
        trainer(sys.argv[2], sys.argv[3], int(sys.argv[4]), (sys.argv[5:] or [None])[0])
    else:
        held_serve(sys.argv[2], sys.argv[3], sys.argv[5:])
