"""Hold a save in flight (the background write waits at its first storage call until
released), and run calls on a writer's event-loop thread."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import pytest

from checkpointd.storage import LocalStore
from checkpointd.write.handle import SaveHandle
from checkpointd.write.loop import InProcessBackend


def hold_local_writes(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make every LocalStore.make_dir (a save's first storage call) wait for the returned
    event: saves stay in flight until the test sets it. Runs on the writer's worker threads."""
    gate = threading.Event()
    real = LocalStore.make_dir

    def make_dir(self: LocalStore, path: str) -> None:
        if not gate.wait(60):
            raise TimeoutError("the test never released the held write")
        real(self, path)

    monkeypatch.setattr(LocalStore, "make_dir", make_dir)
    return gate


class OnLoop:
    """Runs calls on a writer's event-loop thread: each queued call runs when the next
    save is handed to the in-process backend (``InProcessBackend.submit`` runs on that loop),
    and its outcome (its result, awaited if it is awaitable, or the exception it
    raised) is appended to ``outcomes``. For tests of what happens on that thread."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.queued: list[Callable[[], Any]] = []
        self.outcomes: list[Any] = []
        real = InProcessBackend.submit

        async def submit(service: InProcessBackend, snapshot: Any, handle: SaveHandle) -> None:
            while self.queued:
                call = self.queued.pop(0)
                try:
                    outcome = call()
                    if inspect.isawaitable(outcome):
                        outcome = await outcome
                except Exception as exc:
                    outcome = exc
                self.outcomes.append(outcome)
            await real(service, snapshot, handle)

        monkeypatch.setattr(InProcessBackend, "submit", submit)
