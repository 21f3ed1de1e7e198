"""Hold a save in flight: the background write waits at its first storage call until released."""

from __future__ import annotations

import threading

import pytest

from checkpointd.storage import LocalStore


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
