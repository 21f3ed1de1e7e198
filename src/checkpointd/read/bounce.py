"""Stored bytes to device memory through a small reused host bounce buffer.

A tensor on an accelerator cannot be read into: its bytes are read from storage into
host staging, checksummed there, and copied to the device. ``Bounce`` holds two staging
blocks of ``tunables.BOUNCE_BYTES / 2`` (pinned for CUDA, so the host-to-device copy
is a non-blocking DMA) and alternates between them through ``crc32c_stream``: block
k+1 is read by its helper thread while block k is checksummed and copied, and a block
is reused only after the copy out of it is known complete (a recorded CUDA event,
waited on the host). The device is reached through a ``Transfer`` (a target device,
whether staging is pinned, a copy and a wait), so the same path runs on a CPU
"device" (``tunables.BOUNCE_CPU_TARGETS``: the tests, on machines without a GPU).
``stream`` returns the CRC32C of everything it passed; the caller compares it with the
manifest before it trusts what landed (landing.py for restore, todevice.py for load).

Blocking; one thread at a time per ``Bounce`` (a lock serialises users; the helper
thread of ``crc32c_stream`` reads while the caller's thread checksums and copies).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

import torch

from checkpointd import tunables
from checkpointd.format.checksum import Span, crc32c_each, crc32c_stream

__all__ = [
    "Block",
    "Bounce",
    "CudaTransfer",
    "HostTransfer",
    "Piece",
    "Transfer",
    "needs_bounce",
    "resolved",
    "transfer_for",
]


class Transfer(Protocol):
    """How host bytes reach one device: ``copy`` may return before the copy is done;
    ``wait`` blocks until every copy issued so far has read its source."""

    device: torch.device
    pinned: bool
    """Whether staging is allocated in page-locked memory (required for an
    asynchronous host-to-device copy)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def wait(self) -> None: ...


@dataclass
class HostTransfer:
    """A CPU "device": a plain synchronous copy out of unpinned staging."""

    device: torch.device
    pinned: bool = False

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def wait(self) -> None:
        return None


class CudaTransfer:
    """A CUDA device: non-blocking copies out of pinned staging on the device's current
    stream (so they follow the work already queued on it), each followed by an event
    that ``wait`` synchronises on."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = True
        self._event: torch.cuda.Event | None = None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(dst.device))
        self._event = event

    def wait(self) -> None:
        event, self._event = self._event, None
        if event is not None:
            event.synchronize()


def transfer_for(device: torch.device) -> Transfer | None:
    """The transfer that lands bytes on ``device``, or None where they are read straight
    into its memory (CPU, unless ``tunables.BOUNCE_CPU_TARGETS``) or the device is not
    one this path knows (those keep the plain path: read on host, then ``copy_``)."""
    if device.type == "cuda":
        return CudaTransfer(device)
    if device.type == "cpu" and tunables.BOUNCE_CPU_TARGETS:
        return HostTransfer(device)
    return None


def resolved(device: torch.device) -> torch.device:
    """``device`` with its index filled in from the calling thread's current CUDA device
    ("cuda" means that one; reading threads would otherwise take their own, device 0)."""
    index: int | None = device.index  # torch's stubs say int; "cuda" has None
    if device.type == "cuda" and index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def needs_bounce(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s bytes land through a ``Bounce`` rather than being read into."""
    return transfer_for(tensor.device) is not None


@dataclass(frozen=True)
class Piece:
    """Bytes of a file to land in ``dst`` (a flat uint8 tensor, on its device) read from
    ``offset`` of the file."""

    dst: torch.Tensor
    offset: int


@dataclass(frozen=True)
class Block:
    """``length`` bytes read from ``offset`` of a file into a staging block, then, for each
    (dst, begin, end) of ``copies``, bytes [begin, end) of it copied into ``dst`` (a
    flat uint8 tensor of exactly end - begin bytes, on its device)."""

    length: int
    offset: int
    copies: tuple[tuple[torch.Tensor, int, int], ...]


class Bounce:
    """Two reused staging blocks and the streaming through them. Allocated on first use
    (pinned if the first transfer wants it), freed by ``close`` (or the ``with`` block)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: list[torch.Tensor] = []
        self._pinned = False
        self._transfers: dict[torch.device, Transfer] = {}

    def __enter__(self) -> Bounce:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Drop the staging blocks (after every copy out of them has completed)."""
        with self._lock:
            self._blocks = []
            self._transfers = {}

    def _transfer(self, device: torch.device) -> Transfer:
        transfer = self._transfers.get(device)
        if transfer is None:
            found = transfer_for(device)
            transfer = HostTransfer(device) if found is None else found
            self._transfers[device] = transfer
        return transfer

    def _staging(self, pinned: bool, least: int) -> list[torch.Tensor]:
        """The two staging blocks, of ``BOUNCE_BYTES / 2`` or ``least`` bytes if more."""
        block = max(1, tunables.BOUNCE_BYTES // 2, least)
        if not self._blocks or self._pinned != pinned or self._blocks[0].numel() != block:
            self._blocks = []  # the old pair is freed before the new one is allocated
            self._blocks = [
                torch.empty(block, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)
            ]
            self._pinned = pinned
        return self._blocks

    def stream(
        self,
        read: Callable[[memoryview, int], None],
        items: Sequence[memoryview | Piece],
    ) -> int:
        """The CRC32C of ``items`` in file order: a memoryview is bytes already in host
        memory (checksummed as they are), a ``Piece`` is read through the staging blocks,
        a block at a time by ``read(view, offset)``, and copied into its ``dst``. Every
        copy has completed when this returns or raises."""
        size = max(1, tunables.BOUNCE_BYTES // 2)
        spans: list[memoryview | Block] = []
        for item in items:
            if isinstance(item, memoryview):
                spans.append(item)
                continue
            total = item.dst.numel()
            for at in range(0, total, size):
                n = min(size, total - at)
                spans.append(Block(n, item.offset + at, ((item.dst[at : at + n], 0, n),)))
        return self.run(read, spans, chained=True)[-1] if spans else 0

    def run(
        self,
        read: Callable[[memoryview, int], None],
        items: Sequence[memoryview | Block],
        *,
        chained: bool,
    ) -> list[int]:
        """``chained``: [the CRC32C of all ``items``], else the CRC32C of each item on its
        own (per-block digests), in file order: a memoryview is checksummed where it is,
        a ``Block`` read into one of the two staging blocks (alternately), checksummed
        there, and copied out. Every copy has completed when this returns or raises."""
        with self._lock:
            blocks = [i for i in items if isinstance(i, Block)]
            used = {dst.device for b in blocks for dst, _, _ in b.copies}
            transfers = [self._transfer(device) for device in used]
            staging = self._staging(
                any(t.pinned for t in transfers), max((b.length for b in blocks), default=1)
            )
            spans: list[Span] = []
            copies: dict[int, tuple[Block, torch.Tensor]] = {}  # span -> block, staging
            for item in items:
                if isinstance(item, memoryview):
                    spans.append((item, None))
                    continue
                src = staging[len(copies) % 2][: item.length]
                copies[len(spans)] = (item, src)
                spans.append((src.numpy().data.cast("B"), item.offset))

            def after(index: int, _: memoryview) -> None:
                # Runs before span index + 2 is read, possibly into the same staging
                # block: its copies must be done by then (the next block is being read
                # meanwhile, by the helper thread).
                found = copies.get(index)
                if found is None:
                    return
                block, src = found
                done: set[torch.device] = set()
                for dst, begin, end in block.copies:
                    transfer = self._transfer(dst.device)
                    transfer.copy(dst, src[begin:end])
                    done.add(dst.device)
                for device in done:
                    self._transfer(device).wait()

            try:
                if chained:
                    return [crc32c_stream(spans, read, after)] if spans else []
                return crc32c_each(spans, read, after)
            finally:
                for transfer in transfers:
                    transfer.wait()
