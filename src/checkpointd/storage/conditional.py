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
import threading
from abc import abstractmethod
from collections.abc import Callable

from checkpointd.errors import CheckpointExistsError
from checkpointd.storage.fsspec import FsspecStore

__all__ = ["PROBE_PREFIX", "ConditionalCreateStore", "probe_exclusive_create", "probe_key"]

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


class ConditionalCreateStore(FsspecStore):
    """An fsspec object store whose exclusive publish is the server's conditional create
    (S3 and Azure ``If-None-Match: *``, GCS ``ifGenerationMatch=0``), probed once.

    A subclass implements ``_put`` and ``_refused_as_existing``, sets ``probe_errors``
    (what a server that rejects the condition raises) and calls ``_start_probing``
    in ``__init__``. Blocking; any thread.
    """

    probe_errors: tuple[type[BaseException], ...] = (OSError,)

    def _start_probing(self) -> None:
        """Nothing known yet: the first publish probes."""
        self._probe_lock = threading.Lock()
        self._exclusive: bool | None = None

    @abstractmethod
    def _put(self, target: str, data: bytes, exclusive: bool) -> None:
        """One upload of ``data`` to ``target``, conditional on absence if ``exclusive``;
        raw backend errors."""

    @abstractmethod
    def _refused_as_existing(self, exc: BaseException) -> bool:
        """True if ``exc`` is a conditional create refused because the object exists."""

    @property
    def exclusive_create(self) -> bool:
        """Probed once per store (on first publish): does the condition refuse an object
        that exists? The probe writes and removes one object under the root."""
        with self._probe_lock:
            if self._exclusive is None:
                with self._translating("probe exclusive create under", self.root):
                    self._exclusive = probe_exclusive_create(
                        self._put,
                        self.fs.rm_file,
                        probe_key(self.root),
                        self._refused_as_existing,
                        self.probe_errors,
                    )
            return self._exclusive

    def _publish_exclusive(self, path: str, data: bytes) -> None:
        target = self._abs(path)
        with self._translating("publish", target):
            try:
                self._put(target, data, exclusive=True)
            except OSError as exc:
                if not self._refused_as_existing(exc):
                    raise
                # A retried upload whose first attempt landed sees its own object: success.
                if self._holds(path, data):
                    return
                raise CheckpointExistsError(f"{self.url}/{path} already exists") from None
