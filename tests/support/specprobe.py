"""Imported only if build() imports it: records that it was imported (hostile-spec tests)."""

from __future__ import annotations

import os

_marker = os.environ.get("CHECKPOINTD_SPECPROBE")
if _marker:
    with open(_marker, "w") as f:
        f.write("imported")


class Probe:
    def __init__(self) -> None:
        if _marker:
            with open(_marker, "a") as f:
                f.write(" called")


class _Private(Probe):
    """A private name in an allowed module: build must refuse it before importing this module."""
