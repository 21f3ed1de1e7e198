"""CRC32C (Castagnoli), hardware-accelerated where the CPU has it."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence

from fastcrc import crc32 as _crc32

__all__ = ["BytesLike", "crc32c", "crc32c_combine", "crc32c_each", "crc32c_stream"]

BytesLike = bytes | bytearray | memoryview


def crc32c(data: BytesLike, value: int = 0) -> int:
    """Return the CRC32C of ``data``, continuing from ``value``; releases the GIL on large inputs."""
    return _crc32.iscsi(data, value)


_POLY = 0x82F63B78  # CRC32C, reflected


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC32C polynomial (reflected bit order), as in zlib's crc32.c."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _x2n_table() -> list[int]:
    """x^(2^k) modulo the polynomial for k = 0..63. Not 32 entries reused modulo 32 as
    in zlib: that holds for CRC-32's polynomial, not for CRC32C's (it gave wrong
    results for a second part of 2^29 bytes or more)."""
    table, p = [], 1 << 30  # x^1
    for _ in range(64):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()
_SHIFTS: dict[int, int] = {}


def _shift(length: int) -> int:
    """x^(8 * length) modulo the polynomial: appending ``length`` bytes to a CRC."""
    op = _SHIFTS.get(length)
    if op is None:
        p, n, k = 1 << 31, length, 3
        while n:
            if n & 1:
                p = _multmodp(_X2N[k], p)
            n >>= 1
            k += 1
        op = p
        if len(_SHIFTS) < 64:  # the few chunk lengths a process reads with
            _SHIFTS[length] = op
    return op


def crc32c_combine(first: int, second: int, second_length: int) -> int:
    """The CRC32C of A + B from the CRC32C of A, that of B and B's length (zlib's
    crc32_combine for the Castagnoli polynomial): chunks checksummed in parallel."""
    return _multmodp(_shift(second_length), first) ^ second


Span = tuple[memoryview, int | None]
"""A piece of a file in order: where its bytes are (or go), and its offset in the file if
it still has to be read (None: already in memory)."""


def crc32c_stream(
    spans: Sequence[Span],
    read: Callable[[memoryview, int], None],
    after: Callable[[int, memoryview], None] | None = None,
) -> int:
    """The CRC32C of ``spans`` in order, reading and checksumming on two cores.

    A span with an offset is first filled by ``read(view, offset)``; the next span's
    read runs in a helper thread while this one is checksummed on the caller's thread
    (both release the GIL); ``after(i, view)`` then runs on span ``i`` before span
    ``i + 2`` is read (so two buffers may alternate between spans). Spans that are all
    in memory already are checksummed in two halves on two cores, then ``after`` runs on
    each in order. Blocking.
    """
    if spans and all(offset is None for _, offset in spans):
        return _in_memory(spans, after)
    return _stream(spans, read, after, chained=True)[-1] if spans else 0


def crc32c_each(
    spans: Sequence[Span],
    read: Callable[[memoryview, int], None],
    after: Callable[[int, memoryview], None] | None = None,
    *,
    pieces: Sequence[Sequence[int]] | None = None,
) -> list[int]:
    """As ``crc32c_stream``, but the CRC32C of each span on its own (per-block digests);
    with ``pieces``, of each piece of each span instead: ``pieces[i]`` the lengths of
    span ``i``'s consecutive pieces from its start (several blocks read at once)."""
    return _stream(spans, read, after, chained=False, pieces=pieces)


def _stream(
    spans: Sequence[Span],
    read: Callable[[memoryview, int], None],
    after: Callable[[int, memoryview], None] | None,
    *,
    chained: bool,
    pieces: Sequence[Sequence[int]] | None = None,
) -> list[int]:
    """The digest after each span, continued from the previous one if ``chained``; or,
    with ``pieces`` (not chained), of each of its pieces."""
    digests: list[int] = []
    digest = 0

    def each(i: int, view: memoryview) -> None:
        at = 0
        for length in pieces[i] if pieces is not None else (len(view),):
            digests.append(crc32c(view[at : at + length]))
            at += length

    if len(spans) == 1:  # nothing to overlap: no helper thread
        view, offset = spans[0]
        if offset is not None:
            read(view, offset)
        if chained:
            digests.append(crc32c(view))
        else:
            each(0, view)
        if after is not None:
            after(0, view)
        return digests
    with concurrent.futures.ThreadPoolExecutor(1) as pool:

        def start(i: int) -> concurrent.futures.Future[None] | None:
            if i >= len(spans):
                return None
            view, offset = spans[i]
            return None if offset is None else pool.submit(read, view, offset)

        pending = start(0)
        for i, (view, _) in enumerate(spans):
            if pending is not None:
                pending.result()
            pending = start(i + 1)
            try:
                if chained:
                    digest = crc32c(view, digest)
                    digests.append(digest)
                else:
                    each(i, view)
                if after is not None:
                    after(i, view)
            except BaseException:
                if pending is not None:
                    concurrent.futures.wait([pending])
                raise
    return digests


def _in_memory(spans: Sequence[Span], after: Callable[[int, memoryview], None] | None) -> int:
    """``crc32c_stream`` of spans already in memory: the first half of the bytes (a span
    cut where the half ends) on a helper thread, the second on the caller's, combined."""
    views = [view for view, _ in spans]
    half = sum(len(view) for view in views) // 2
    first: list[memoryview] = []
    second: list[memoryview] = []
    at = 0
    for view in views:
        cut = min(max(half - at, 0), len(view))
        first.append(view[:cut])
        second.append(view[cut:])
        at += len(view)

    def chain(part: list[memoryview]) -> int:
        digest = 0
        for view in part:
            digest = crc32c(view, digest)
        return digest

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        head = pool.submit(chain, first)
        tail = chain(second)
        digest = crc32c_combine(head.result(), tail, sum(len(view) for view in second))
    if after is not None:
        for i, view in enumerate(views):
            after(i, view)
    return digest
