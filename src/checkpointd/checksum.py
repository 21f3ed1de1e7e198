"""CRC32C (Castagnoli), hardware-accelerated where the CPU has it."""

from __future__ import annotations

import crc32c as _crc32c

__all__ = ["BytesLike", "crc32c"]

BytesLike = bytes | bytearray | memoryview


def crc32c(data: BytesLike, value: int = 0) -> int:
    """Return the CRC32C of ``data``, continuing from ``value``; releases the GIL on large inputs."""
    return int(_crc32c.crc32c(data, value))
