"""format/checksum.py's streams: the CRC32C of spans read in turn (chained, per span, or
per piece of a span), each the same as the plain CRC32C of those bytes."""

from __future__ import annotations

import itertools
import os

import crc32c as reference
import pytest

from checkpointd.format.checksum import crc32c_each, crc32c_stream

DATA = os.urandom(100_000)


def _read(view: memoryview, offset: int) -> None:
    view[:] = DATA[offset : offset + len(view)]


def _spans(cuts: list[int]) -> list[tuple[memoryview, int | None]]:
    return [(memoryview(bytearray(b - a)), a) for a, b in itertools.pairwise(cuts)]


@pytest.mark.parametrize("cuts", [[0, 100_000], [0, 10, 5000, 99_999, 100_000]])
def test_a_stream_is_the_crc32c_of_all_its_spans(cuts: list[int]) -> None:
    assert crc32c_stream(_spans(cuts), _read) == reference.crc32c(DATA)


def test_each_span_on_its_own() -> None:
    cuts = [0, 7, 30_000, 30_001, 100_000]
    expected = [reference.crc32c(DATA[a:b]) for a, b in itertools.pairwise(cuts)]
    assert crc32c_each(_spans(cuts), _read) == expected


@pytest.mark.parametrize("reads", [[(0, 100_000)], [(0, 60_000), (60_000, 100_000)]])
def test_each_piece_of_spans_read_whole(reads: list[tuple[int, int]]) -> None:
    blocks = [(0, 1), (1, 20_000), (20_000, 60_000), (60_000, 60_008), (60_008, 100_000)]
    spans = [(memoryview(bytearray(b - a)), a) for a, b in reads]
    pieces = [[e - s for s, e in blocks if a <= s and e <= b] for a, b in reads]
    expected = [reference.crc32c(DATA[s:e]) for s, e in blocks]
    assert crc32c_each(spans, _read, pieces=pieces) == expected
