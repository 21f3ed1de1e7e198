"""Plain CPU tensor copies into the staging arena, shared by the cores that are free.

``Tensor.copy_`` splits every large copy over torch's intra-op (OpenMP) threads and
waits for all of them at a barrier, one barrier per tensor. When the cores are busy
(the training job's other threads, an S3 server, other jobs), a descheduled OpenMP
thread holds up each barrier: a 244 MiB model of 96 tensors took 0.18 s median (0.49 s
at worst) to capture at load 3.5 on 2 cores, against 0.024 s copied by one thread.
Here the bytes are cut into chunks that the calling thread and a few helper threads
take in turn (``ctypes.memmove``, which releases the GIL): the caller never waits for a
thread that has not started, only for a chunk a helper is already copying. Used for
the copies a save makes on the caller's thread (capture's, and overlapped staging's
unguarded ones); the background copier keeps to one thread (staging.py). Blocking.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import os
from collections.abc import Sequence

import torch

__all__ = ["copy_plain", "copy_spans", "plain"]

CHUNK_BYTES = 8 * 2**20
"""Bytes one thread copies at a time: the longest the caller waits for a helper."""

MAX_THREADS = 4
"""Threads that copy at once, the caller included (memory bandwidth is shared)."""

PARALLEL_MIN_BYTES = 4 * CHUNK_BYTES
"""Below this, one thread copies everything: helpers would cost more than they save."""

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
    return max(1, min(MAX_THREADS, cores))


def copy_plain(copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each ``(source, target)`` pair, every one ``plain``, byte for byte; returns
    once all bytes are copied. Caller's thread (it copies too)."""
    copy_spans(
        [
            (target.data_ptr(), source.data_ptr(), source.numel() * source.element_size())
            for source, target in copies
        ]
    )


def copy_spans(spans: Sequence[tuple[int, int, int]]) -> None:
    """Copy each ``(destination address, source address, bytes)`` span, none overlapping
    another; returns once all bytes are copied. The caller keeps both sides alive (and
    mapped) until then. Caller's thread (it copies too)."""
    chunks: list[tuple[int, int, int]] = []
    total = 0
    for dst, src, nbytes in spans:
        for start in range(0, nbytes, CHUNK_BYTES):
            chunks.append((dst + start, src + start, min(CHUNK_BYTES, nbytes - start)))
        total += nbytes
    pending = iter(chunks)

    def work() -> None:
        for dst, src, nbytes in pending:  # a shared iterator: each chunk goes once
            ctypes.memmove(dst, src, nbytes)

    helpers = min(_threads(), len(chunks)) - 1
    if helpers <= 0 or total < PARALLEL_MIN_BYTES:
        work()
        return
    pool = concurrent.futures.ThreadPoolExecutor(helpers, thread_name_prefix="checkpointd-copy")
    started: list[concurrent.futures.Future[None]] = []
    try:
        with contextlib.suppress(RuntimeError):  # no new threads (interpreter exiting)
            for _ in range(helpers):
                started.append(pool.submit(work))
        work()
    finally:
        # helpers that never got a core are not waited for; one copying a chunk is
        pool.shutdown(wait=False, cancel_futures=True)
    for future in started:
        if not future.cancelled():
            future.result()
