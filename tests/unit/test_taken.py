"""``targets.Taken``: the memory already taken to land bytes in, so no two live tensors
that share bytes both take them (restore reads the second the usual way)."""

from __future__ import annotations

import torch

from checkpointd.read.targets import Taken


def test_disjoint_pieces_of_one_buffer_are_taken_and_overlaps_refused() -> None:
    base = torch.zeros(100, dtype=torch.uint8)
    taken = Taken()
    assert taken.take(base[10:20], 10)
    assert taken.take(base[30:40], 10)
    assert taken.take(base[20:30], 10)  # touching both neighbours, overlapping neither
    assert not taken.take(base[15:16], 1)  # inside a taken piece
    assert not taken.take(base[5:11], 6)  # over a piece's first byte
    assert not taken.take(base[39:50], 11)  # over a piece's last byte
    assert not taken.take(base[0:100], 100)  # around every piece
    assert taken.take(base[0:10], 10)
    assert taken.take(base[40:100], 60)


def test_a_refused_piece_takes_nothing() -> None:
    base = torch.zeros(100, dtype=torch.uint8)
    taken = Taken()
    assert taken.take(base[40:60], 20)
    assert not taken.take(base[0:50], 50)
    assert taken.take(base[0:40], 40)  # the refused piece's free part was not kept


def test_memory_is_told_apart_per_device() -> None:
    a = torch.zeros(10, dtype=torch.uint8)
    taken = Taken()
    assert taken.take(a, 10)
    assert not taken.take(a, 10)
    assert taken.take(torch.zeros(10, dtype=torch.uint8, device="meta"), 10)
