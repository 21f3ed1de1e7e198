"""Large values in a real TCPStore go as chunks; small ones as they are."""

from __future__ import annotations

import pytest
from torch.distributed import TCPStore

from checkpointd import tunables
from checkpointd.ranks import values


@pytest.fixture
def store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)


def test_a_value_over_the_store_payload_limit_round_trips_in_chunks(store: TCPStore) -> None:
    big = bytes(range(256)) * (40 * 2**20 // 256 + 3)  # over the libuv store's 8 MiB
    assert values.put(store, "k", big) == big
    assert values.get(store, "k") == big
    assert (
        bytes(store.get("k")) == b"\0chunks:11"
    )  # 40 MiB + 768 bytes: 10 chunks of 4 MiB and one more
    assert values.put(store, "small", b'{"a":1}') == b'{"a":1}'
    assert bytes(store.get("small")) == b'{"a":1}'


def test_once_keeps_the_first_value(store: TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tunables, "STORE_VALUE_BYTES", 4)
    assert values.put(store, "o", b"first value", once=True) == b"first value"
    assert values.get(store, "o") == b"first value"
    assert values.put(store, "p", b"ok", once=True) == b"ok"
    assert values.put(store, "p", b"failed", once=True) == b"ok"
