"""A follower of a many-rank save blocks in the c10d store's ``wait`` for the outcome and
for ``published`` instead of polling: on a real TCPStore, with real heartbeat threads, it
wakes as soon as the key is set, costs the store a few calls whatever the wait's length,
keeps its own heartbeat beating while it waits, and still gives up on a publisher whose
heartbeat stopped."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import anyio
import pytest
from torch.distributed import PrefixStore, TCPStore

from checkpointd import tunables
from checkpointd.ranks.attempt import Attempt, wait_for
from checkpointd.ranks.group import Group


class Counting:
    """A c10d store that counts the calls made on it (its clones count into the same)."""

    def __init__(self, store: Any, calls: Counter[str] | None = None) -> None:
        self.store = store
        self.calls: Counter[str] = Counter() if calls is None else calls

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def call(*args: Any) -> Any:
            self.calls[name] += 1
            return method(*args)

        return call

    def clone(self) -> Counting:
        return Counting(self.store.clone(), self.calls)


@pytest.fixture
def server() -> TCPStore:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    return store


def _client(server: TCPStore) -> Any:
    return PrefixStore("w/", TCPStore("127.0.0.1", server.port, is_master=False, use_libuv=True))


def _groups(server: TCPStore, *, publisher_beats: bool) -> tuple[Group, Group, Counting]:
    publisher = Group(_client(server), 0, 2, "t", join_seconds=60, heartbeat=publisher_beats)
    counted = Counting(_client(server))
    follower = Group(counted, 1, 2, "t", join_seconds=60)
    return publisher, follower, counted


def test_a_follower_wakes_when_the_outcome_is_set_and_does_not_poll(server: TCPStore) -> None:
    publisher, follower, counted = _groups(server, publisher_beats=True)
    try:
        before = follower.heartbeat(1)
        counted.calls.clear()
        decided = threading.Timer(3.0, Attempt(publisher, 5, 0).decide, [b"committed"])
        decided.start()
        started = time.monotonic()
        outcome = anyio.run(wait_for, Attempt(follower, 5, 0), "outcome", [0])
        waited = time.monotonic() - started
        decided.join()
        assert outcome == b"committed"
        assert waited > 2.9
        # Woken by the set: one wait (a timeout would start another), one read, and no
        # polls (POLL_SECONDS polling would make ~60 calls).
        assert counted.calls["wait"] == 1, counted.calls
        assert sum(counted.calls.values()) < 15, counted.calls
        # The wait has a connection of its own: the heartbeat kept beating meanwhile.
        assert follower.heartbeat(1) - before >= 2
    finally:
        publisher.close()
        follower.close()


def test_a_long_wait_for_the_outcome_logs_no_store_timeouts(
    server: TCPStore, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Heartbeats are looked at every WAIT_SECONDS while the wait itself goes on: a wait
    that timed out each time would print c10d's "likely a timeout" warnings to stderr
    on every follower of every long save."""
    monkeypatch.setattr(tunables, "WAIT_SECONDS", 0.3)
    publisher, follower, counted = _groups(server, publisher_beats=True)
    try:
        decided = threading.Timer(2.0, Attempt(publisher, 6, 0).decide, [b"committed"])
        decided.start()
        capfd.readouterr()
        assert anyio.run(wait_for, Attempt(follower, 6, 0), "outcome", [0]) == b"committed"
        decided.join()
        assert "timeout" not in capfd.readouterr().err
        assert counted.calls["wait"] == 1, counted.calls  # looked 6 times, waited once
    finally:
        publisher.close()
        follower.close()


def test_a_follower_gives_up_on_a_publisher_whose_heartbeat_stopped(
    server: TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tunables, "STALE_SECONDS", 1.5)
    publisher, follower, counted = _groups(server, publisher_beats=False)
    try:
        started = time.monotonic()
        outcome = anyio.run(wait_for, Attempt(follower, 7, 0), "outcome", [0])
        waited = time.monotonic() - started
        assert outcome is not None
        assert outcome.startswith(b"abandoned: rank 1: rank(s) [0] stopped responding"), outcome
        # Noticed one stale period after the first look; giving up ended the wait, long
        # before its own timeout (a round of 300 s).
        assert 1.5 <= waited < 30
        assert counted.calls["wait"] <= 8, counted.calls
        # A wait whose rank died may end None instead (published, give_up=False).
        assert (
            anyio.run(lambda: wait_for(Attempt(follower, 8, 0), "published", [0], give_up=False))
            is None
        )
    finally:
        publisher.close()
        follower.close()


def test_a_wait_after_the_store_died_fails_at_once(tmp_path: Any) -> None:
    """The wait's connection is made with the group: a first wait after the rank hosting
    the store died fails typed at once (a connection made then would retry the connect
    for the store's whole timeout)."""
    import subprocess
    import sys

    from checkpointd.errors import RankFailedError

    port_file = tmp_path / "port"
    host = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from torch.distributed import TCPStore; "
            "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); "
            "open(sys.argv[1], 'w').write(str(s.port)); time.sleep(600)",
            str(port_file),
        ]
    )
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        client = TCPStore("127.0.0.1", int(port_file.read_text()), is_master=False)
        follower = Group(PrefixStore("w/", client), 1, 2, "t", join_seconds=60, heartbeat=False)
        host.kill()
        host.wait()
        started = time.monotonic()
        with pytest.raises(RankFailedError, match="store is unreachable"):
            Attempt(follower, 9, 0).wait("outcome", 5.0)
        assert time.monotonic() - started < 5
    finally:
        host.kill()
        host.wait()
