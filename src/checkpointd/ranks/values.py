"""Values of any size in the job's c10d store, which refuses large ones.

The libuv TCPStore (torch's default since 2.4) drops the connection of a client
that sends a value over 8 MiB ("Invalid payload size"); a many-rank manifest
passes that at a few dozen ranks, a rank's post with enough shards too. A value
over tunables.STORE_VALUE_BYTES is therefore stored as chunks under
``KEY/chunkI``, written first, and ``KEY`` holds a marker with their count, so a
reader that sees ``KEY`` finds every chunk. Posted values are msgspec JSON and
never start with the marker's NUL byte. Blocking: worker threads.
"""

from __future__ import annotations

from typing import Any

from checkpointd import tunables

__all__ = ["get", "put"]

_MARK = b"\0chunks:"


def put(store: Any, key: str, value: bytes, *, once: bool = False) -> bytes:
    """Store ``value`` at ``key`` (``once``: unless ``key`` is set); the value that holds
    at ``key`` (ours unless ``once`` found one; read it with ``get`` if it may be large)."""
    size = tunables.STORE_VALUE_BYTES
    head = value
    if len(value) > size:
        count = 0
        for count, at in enumerate(range(0, len(value), size), start=1):
            store.set(f"{key}/chunk{count - 1}", value[at : at + size])
        head = _MARK + str(count).encode()
    if once:
        held = bytes(store.compare_set(key, "", head))
        return value if held == head else held
    store.set(key, head)
    return value


def get(store: Any, key: str) -> bytes:
    """The value at ``key`` (set: check first), its chunks joined if it was chunked."""
    head = bytes(store.get(key))
    if not head.startswith(_MARK):
        return head
    count = int(head[len(_MARK) :])
    return b"".join(bytes(store.get(f"{key}/chunk{i}")) for i in range(count))
