"""Content digests of tensor bytes: what decides that a tensor is unchanged.

XXH3-128 (the ``xxhash`` package): measured 13.7 GB/s on one core against
1.7 GB/s for BLAKE3 single-threaded (2.7 GB/s on two threads) and 6 GB/s for
CRC32C, and 128 bits make an accidental match between two different tensors
negligible (a 32-bit CRC would not: a false match restores stale weights). It
releases the GIL, so hashing in a worker thread leaves the training thread
running. Not cryptographic: it guards against accidents, not an adversary who
can write into the root (who could replace the bytes anyway). Any thread.
"""

from __future__ import annotations

import xxhash

from checkpointd.format.checksum import BytesLike
from checkpointd.format.layout import BLOB_PREFIX

__all__ = ["BlobHasher", "blob_name"]


def blob_name(data: BytesLike) -> str:
    """The content-addressed name of ``data``: ``xxh128-`` and 32 hex digits. Any thread."""
    return BLOB_PREFIX + xxhash.xxh3_128_hexdigest(data)


class BlobHasher:
    """``blob_name`` of bytes fed piece by piece (verify streams a blob). One thread."""

    def __init__(self) -> None:
        self._state = xxhash.xxh3_128()

    def update(self, data: BytesLike) -> None:
        """Add the next piece."""
        self._state.update(data)

    def name(self) -> str:
        """The blob name of everything fed so far."""
        return BLOB_PREFIX + self._state.hexdigest()
