"""Probing a server's conditional create, for object stores whose exclusive publish
depends on the server (GCS ``ifGenerationMatch=0``, Azure ``If-None-Match: *``).

Emulators and compatible servers often accept the condition and ignore it. A
store that asks the server once, before its first publish, gets the truth: the
exclusive publish where the server refuses to create over an existing object,
the guarded publish (and its once-per-store warning, storage/base.py) where it
does not. Blocking; any thread (the caller holds the store's lock).
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable

__all__ = ["PROBE_PREFIX", "probe_exclusive_create", "probe_key"]

PROBE_PREFIX = ".checkpointd-probe-"
"""Name prefix of the one object a probe writes (and removes) under the root."""


def probe_key(root: str) -> str:
    """A fresh probe object's full key under ``root``."""
    return f"{root}/{PROBE_PREFIX}{secrets.token_hex(8)}"


def probe_exclusive_create(
    put: Callable[[str, bytes, bool], None],
    remove: Callable[[str], None],
    key: str,
    refused_as_existing: Callable[[BaseException], bool],
    errors: tuple[type[BaseException], ...],
) -> bool:
    """True if ``put(key, data, exclusive=True)`` refuses an object that exists.

    Creates ``key`` exclusively, then tries again exclusively: that second try
    must be refused (``refused_as_existing``). A server that rejects the
    condition outright (``errors`` from the first try, while a plain put works)
    lacks it too. Errors of the plain put, and other errors of the second try,
    propagate raw (the caller translates them). ``key`` is removed (best effort)."""
    try:
        try:
            put(key, b"probe", True)
        except errors as exc:
            if refused_as_existing(exc):
                raise  # a fresh random key cannot exist: the server is confused
            put(key, b"probe", False)
            return False
        try:
            put(key, b"probe again", True)
        except errors as exc:
            if refused_as_existing(exc):
                return True
            raise
        return False
    finally:
        with contextlib.suppress(Exception):
            remove(key)
