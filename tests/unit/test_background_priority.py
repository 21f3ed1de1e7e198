"""``priority.lowest`` (a replica's bytes and pages): the work runs on a thread of its
own at niceness 19, its result or exception comes back, and the calling thread keeps
its own niceness."""

from __future__ import annotations

import os
import threading

import pytest

from checkpointd.daemon.server.priority import LOWEST_NICENESS, lowest


def _niceness() -> tuple[int, int]:
    tid = threading.get_native_id()
    return tid, os.getpriority(os.PRIO_PROCESS, tid)


def test_background_work_runs_at_the_lowest_priority_and_leaves_the_caller_as_it_was() -> None:
    caller, before = _niceness()
    worker, niceness = lowest(_niceness)
    assert worker != caller
    assert niceness == LOWEST_NICENESS
    assert _niceness() == (caller, before)

    def fails() -> None:
        raise ValueError("from the background")

    with pytest.raises(ValueError, match="from the background"):
        lowest(fails)
