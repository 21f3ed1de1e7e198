"""Plain CPU copies into the staging arena (memory/bytecopy.py): exact bytes over chunk
and tensor boundaries, shared by helper threads or done alone; anything not plain
(non-contiguous, conjugate, another dtype) is left to torch by capture."""

from __future__ import annotations

import threading
from typing import Any

import crc32c as reference
import pytest
import torch

from checkpointd import tunables
from checkpointd.memory import bytecopy
from checkpointd.write.capture import StagingBuffer, capture


def _pairs(sizes: list[int]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    arena = torch.zeros(sum(sizes), dtype=torch.uint8)
    pairs, offset = [], 0
    for number, size in enumerate(sizes):
        source = torch.randint(
            0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(number)
        )
        pairs.append((source, arena[offset : offset + size]))
        offset += size
    return pairs, arena


@pytest.mark.parametrize("threads", [1, 3])
def test_bytes_arrive_exactly_across_chunks_and_tensors(
    monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    monkeypatch.setattr(tunables, "COPY_CHUNK_BYTES", 4096)
    monkeypatch.setattr(tunables, "COPY_PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(bytecopy, "_threads", lambda: threads)
    names: set[str] = set()
    memmove = bytecopy.ctypes.memmove

    def seen(dst: int, src: int, nbytes: int) -> None:
        names.add(threading.current_thread().name)
        memmove(dst, src, nbytes)

    monkeypatch.setattr(bytecopy.ctypes, "memmove", seen)
    pairs, arena = _pairs([1, 4095, 4096, 4097, 3 * 4096 + 5, 100_000])
    bytecopy.copy_plain(pairs)
    assert torch.equal(arena, torch.cat([source for source, _ in pairs]))
    caller = threading.current_thread().name
    if threads == 1:
        assert names == {caller}
    else:  # whoever is free takes the next chunk: the caller, or up to 2 helpers
        assert len(names) <= threads
        assert names - {caller} <= {f"checkpointd-copy_{n}" for n in range(threads - 1)}


def test_small_copies_stay_on_the_calling_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    started = []
    monkeypatch.setattr(
        bytecopy.concurrent.futures, "ThreadPoolExecutor", lambda *a, **k: started.append(a)
    )
    pairs, arena = _pairs([1000, 2000])
    bytecopy.copy_plain(pairs)
    assert torch.equal(arena, torch.cat([source for source, _ in pairs]))
    assert started == []


def test_only_plain_tensors_are_byte_copied() -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    target = torch.empty(3, 4)
    assert bytecopy.plain(base, target)
    assert bytecopy.plain(torch.nn.Parameter(base.clone()), target)
    assert not bytecopy.plain(base.t(), torch.empty(4, 3))  # not contiguous
    assert not bytecopy.plain(base, torch.empty(3, 4, dtype=torch.float64))
    complex_ = torch.randn(4, dtype=torch.complex64)
    assert not bytecopy.plain(complex_.conj(), torch.empty(4, dtype=torch.complex64))


def test_capture_keeps_values_of_plain_and_other_tensors() -> None:
    complex_ = torch.randn(5, dtype=torch.complex64)
    state = {
        "m": {
            "big": torch.randn(3, 2**20),  # plain: byte-copied, in chunks
            "t": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
            "c": complex_.conj(),  # lazy conjugate: torch resolves it
            "p": torch.nn.Parameter(torch.ones(7)),
        }
    }
    buffer = StagingBuffer()
    (component,) = capture(state, buffer)
    for entry in component.entries:
        tensor = state["m"][entry.name]
        stored = buffer.view(component.offset + entry.begin, entry.end - entry.begin)
        expected = tensor.detach().resolve_conj().contiguous()
        got = torch.frombuffer(bytearray(stored), dtype=tensor.dtype).reshape(tensor.shape)
        assert torch.equal(got, expected), entry.name


def test_without_threads_to_spare_the_caller_copies_everything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As at interpreter exit, when an executor refuses new work."""

    class Refusing(bytecopy.concurrent.futures.ThreadPoolExecutor):
        def submit(self, *_: object, **__: object) -> Any:
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(bytecopy.concurrent.futures, "ThreadPoolExecutor", Refusing)
    monkeypatch.setattr(tunables, "COPY_PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(bytecopy, "_threads", lambda: 3)
    pairs, arena = _pairs([3 * tunables.COPY_CHUNK_BYTES + 1])
    bytecopy.copy_plain(pairs)
    assert torch.equal(arena, torch.cat([source for source, _ in pairs]))


@pytest.mark.parametrize("threads", [1, 3])
def test_a_checked_copy_lands_every_byte_and_checksums_all_pieces_in_order(
    monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    monkeypatch.setattr(tunables, "COPY_CHUNK_BYTES", 4096)
    monkeypatch.setattr(tunables, "COPY_CHECKED_BYTES", 1000)  # not a divisor of a chunk
    monkeypatch.setattr(tunables, "COPY_PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(bytecopy, "_threads", lambda: threads)
    sizes = [0, 1, 4095, 4096, 4097, 3 * 4096 + 5, 50_000]
    pairs, _arena = _pairs(sizes)
    # every other piece lands; the rest (None) are only checksummed, as a header is
    pieces = [
        (target.data_ptr() if i % 2 else None, memoryview(source.numpy()))
        for i, (source, target) in enumerate(pairs)
    ]
    digest = bytecopy.copy_checked(pieces)
    everything = b"".join(bytes(source.numpy()) for source, _ in pairs)
    assert digest == reference.crc32c(everything)
    for i, (source, target) in enumerate(pairs):
        assert torch.equal(target, source if i % 2 else torch.zeros_like(source))
    assert bytecopy.copy_checked([]) == 0


def test_a_checked_copy_checksums_what_landed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The digest is taken over the destination after each step's copy: a copy that
    landed other bytes than its source's gives another digest."""
    memmove = bytecopy.ctypes.memmove

    def scribbling(dst: int, src: int, nbytes: int) -> None:
        memmove(dst, src, nbytes)
        memmove(dst, b"\xff", 1)

    monkeypatch.setattr(bytecopy.ctypes, "memmove", scribbling)
    pairs, _ = _pairs([10_000])
    ((source, target),) = pairs
    digest = bytecopy.copy_checked([(target.data_ptr(), memoryview(source.numpy()))])
    assert digest == reference.crc32c(bytes(target.numpy()))
    assert digest != reference.crc32c(bytes(source.numpy()))


def test_checked_copies_of_groups_give_each_group_its_own_digest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tunables, "COPY_CHUNK_BYTES", 4096)
    monkeypatch.setattr(tunables, "COPY_PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(bytecopy, "_threads", lambda: 3)
    pairs, _ = _pairs([10, 4097, 0, 9000, 3])
    (a, ta), (b, tb), (c, tc), (d, td), (e, te) = pairs
    groups = [
        [(None, memoryview(a.numpy())), (tb.data_ptr(), memoryview(b.numpy()))],
        [],
        [(tc.data_ptr(), memoryview(c.numpy())), (td.data_ptr(), memoryview(d.numpy()))],
        [(None, memoryview(e.numpy()))],
    ]
    digests = bytecopy.copy_checked_each(groups)
    expected = [
        reference.crc32c(bytes(a.numpy()) + bytes(b.numpy())),
        0,
        reference.crc32c(bytes(c.numpy()) + bytes(d.numpy())),
        reference.crc32c(bytes(e.numpy())),
    ]
    assert digests == expected
    assert torch.equal(tb, b)
    assert torch.equal(td, d)
    assert not ta.any()  # only checksummed
    assert not te.any()
