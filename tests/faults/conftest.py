"""Slow fault modes (100+ kills, the full soak) run only with CHECKPOINTD_SLOW=1."""

from __future__ import annotations

import os

import pytest

SLOW = os.environ.get("CHECKPOINTD_SLOW") == "1"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if SLOW:
        return
    skip = pytest.mark.skip(reason="slow mode: run with CHECKPOINTD_SLOW=1 pytest -m slow")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)
