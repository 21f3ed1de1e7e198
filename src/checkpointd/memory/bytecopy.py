"""Plain CPU tensor copies into the staging arena, shared by the cores that are free.

``Tensor.copy_`` splits every large copy over torch's intra-op (OpenMP) threads and
waits for all of them at a barrier, one barrier per tensor. When the cores are busy
(the training job's other threads, an S3 server, other jobs), a descheduled OpenMP
thread holds up each barrier: a 244 MiB model of 96 tensors took 0.18 s median (0.49 s
at worst) to capture at load 3.5 on 2 cores, against 0.024 s copied by one thread.
Here the bytes are cut into chunks that the calling thread and a few helper threads
take in turn (``ctypes.memmove``, which releases the GIL): the caller never waits for a
thread that has not started, only for a chunk a helper is already copying. Used for
the copies a save makes on the caller's thread (capture's, which checksums each tensor
as it lands, ``copy_plain_checked``, and overlapped staging's unguarded ones); the
background copier keeps to one thread (staging.py), and the memory tier's restore
copies and checks in one pass (``copy_checked``). Blocking.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import os
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import numpy as np
import torch

from checkpointd import tunables
from checkpointd.format.checksum import crc32c, crc32c_combine

__all__ = [
    "copy_checked",
    "copy_checked_each",
    "copy_plain",
    "copy_plain_checked",
    "copy_spans",
    "plain",
]

_Chunk = TypeVar("_Chunk")

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def plain(source: torch.Tensor, target: torch.Tensor) -> bool:
    """True if ``source``'s bytes are exactly what ``target`` (a view of the arena of
    the same dtype and shape) must hold: contiguous, strided, CPU, no lazy conjugate
    or negation, a plain tensor type."""
    return (
        type(source) in _PLAIN_TYPES
        and source.device.type == "cpu"
        and target.device.type == "cpu"
        and source.layout == torch.strided
        and source.dtype == target.dtype
        and source.shape == target.shape
        and source.is_contiguous()
        and target.is_contiguous()
        and not source.is_conj()
        and not source.is_neg()
    )


def _threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(tunables.COPY_THREADS, cores))


def copy_plain(copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each ``(source, target)`` pair, every one ``plain``, byte for byte; returns
    once all bytes are copied. Caller's thread (it copies too)."""
    copy_spans(
        [
            (target.data_ptr(), source.data_ptr(), source.numel() * source.element_size())
            for source, target in copies
        ]
    )


def copy_plain_checked(copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """``copy_plain``, returning the CRC32C of each pair's bytes as they landed in its
    target: each piece is checksummed right after its copy, while still in cache
    (``copy_checked``), so the writer need not read the bytes again from memory to
    checksum them. Caller's thread (it copies too)."""
    return copy_checked_each(
        [[(target.data_ptr(), _bytes_at(source))] for source, target in copies]
    )


def _bytes_at(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, any dtype, without copying (the caller
    keeps the tensor alive while the view is used)."""
    return _memory_at(tensor.data_ptr(), tensor.numel() * tensor.element_size())


_memory_view_at = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_view_at.restype = ctypes.py_object
_memory_view_at.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_WRITABLE = 0x200  # PyBUF_WRITE


def _memory_at(address: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` at ``address`` (the caller keeps that memory
    alive while the view is used). About 1 us, where a ctypes array of that length costs
    25 us the first time a length is seen and is then kept for the life of the process:
    capture views every tensor, and 20,000 tensors have thousands of lengths."""
    return _memory_view_at(address, nbytes, _WRITABLE)  # type: ignore[no-any-return]


def copy_spans(spans: Sequence[tuple[int, int, int]]) -> None:
    """Copy each ``(destination address, source address, bytes)`` span, none overlapping
    another; returns once all bytes are copied. The caller keeps both sides alive (and
    mapped) until then. Caller's thread (it copies too)."""
    chunks: list[tuple[int, int, int]] = []
    step = tunables.COPY_CHUNK_BYTES
    for dst, src, nbytes in spans:
        for start in range(0, nbytes, step):
            chunks.append((dst + start, src + start, min(step, nbytes - start)))
    _shared(chunks, lambda chunk: ctypes.memmove(*chunk), sum(n for _, _, n in spans))


def copy_checked(pieces: Sequence[tuple[int | None, memoryview]]) -> int:
    """The CRC32C of all ``pieces``' bytes in order, each piece ``(destination address,
    bytes)`` copied to its destination first and checksummed there as it landed; a piece
    with no destination (None) is only checksummed. One pass over memory instead of a
    check then a copy. Destinations must not overlap each other or any piece; the caller
    keeps them alive until it returns. Caller's thread (it copies too)."""
    return copy_checked_each([pieces])[0]


def copy_checked_each(groups: Sequence[Sequence[tuple[int | None, memoryview]]]) -> list[int]:
    """``copy_checked`` of each group of pieces (a shard's blocks, each with its own
    CRC32C), all groups' chunks shared by the same threads: one digest per group."""
    chunks: list[tuple[int, int | None, memoryview]] = []
    owners: list[int] = []
    size, checked = tunables.COPY_CHUNK_BYTES, tunables.COPY_CHECKED_BYTES
    for group, pieces in enumerate(groups):
        for dst, view in pieces:
            for start in range(0, len(view), size):
                at = None if dst is None else dst + start
                chunks.append((len(chunks), at, view[start : start + size]))
                owners.append(group)
    digests: list[int] = [0] * len(chunks)

    def check(chunk: tuple[int, int | None, memoryview]) -> None:
        index, dst, view = chunk
        if dst is None:
            digests[index] = crc32c(view)
            return
        src = np.frombuffer(view, dtype=np.uint8).ctypes.data
        landed = _memory_at(dst, len(view))
        digest = 0
        for start in range(0, len(view), checked):
            step = min(checked, len(view) - start)
            ctypes.memmove(dst + start, src + start, step)
            digest = crc32c(landed[start : start + step], digest)
        digests[index] = digest

    _shared(chunks, check, sum(len(view) for _, _, view in chunks))
    combined: list[int | None] = [None] * len(groups)
    for (_, _, view), group, part in zip(chunks, owners, digests, strict=True):
        before = combined[group]
        combined[group] = part if before is None else crc32c_combine(before, part, len(view))
    return [0 if digest is None else digest for digest in combined]


def _shared(chunks: Sequence[_Chunk], work: Callable[[_Chunk], object], total: int) -> None:
    """Run ``work`` on every chunk once, taken in turn by the caller and helper threads
    (the caller alone below ``tunables.COPY_PARALLEL_MIN_BYTES``); returns once every
    chunk is done."""
    pending: Iterator[_Chunk] = iter(chunks)

    def drain() -> None:
        for chunk in pending:  # a shared iterator: each chunk goes once
            work(chunk)

    helpers = min(_threads(), len(chunks)) - 1
    if helpers <= 0 or total < tunables.COPY_PARALLEL_MIN_BYTES:
        drain()
        return
    pool = concurrent.futures.ThreadPoolExecutor(helpers, thread_name_prefix="checkpointd-copy")
    started: list[concurrent.futures.Future[None]] = []
    try:
        with contextlib.suppress(RuntimeError):  # no new threads (interpreter exiting)
            for _ in range(helpers):
                started.append(pool.submit(drain))
        drain()
    finally:
        # helpers that never got a core are not waited for; one copying a chunk is
        pool.shutdown(wait=False, cancel_futures=True)
    for future in started:
        if not future.cancelled():
            future.result()
