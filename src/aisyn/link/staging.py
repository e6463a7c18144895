"""A GPU tensor's wire bytes reach the host chunk by chunk, overlapped with the send.

A socket sends from host memory. ``tensor.cpu()`` copies a GPU tensor whole,
into pageable memory, before its first byte can leave: the copy runs at
pageable speed (the driver bounces it through a pinned buffer of its own),
the wire idles meanwhile, and a fresh host buffer of the tensor's size is
allocated each time. :class:`HostStaging` copies one chunk at a time into a
few reused page-locked buffers, on a copy stream of its own, and hands the
sender chunk k while chunk k+1 is still being copied: the wire sees the first
byte after one chunk's copy, the copies run at pinned speed (DMA), and the
host memory held is a few chunks whatever the tensor's size.

Which buffer may be reused when. The link builds frame k+1 before it writes
frame k (``TensorWriter.write``: the last frame is held back until
every read of the tensor is done), so when chunk k+1 is handed out, chunk k
is still to be written, and the copy of chunk k+2 is issued then: three
chunks are alive at once, hence three buffers, used in turn.

The device side is behind :class:`Copier`, so the schedule is tested on any
machine (``tests/link/test_link_staging.py`` drives it with copies that run
on a thread of their own); :class:`CudaCopier` is the real one.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

__all__ = ["Copier", "CudaCopier", "HostStaging", "device_parts"]


class Copier(Protocol):
    """Asynchronous copies from device memory into host buffers."""

    def buffer(self, nbytes: int) -> torch.Tensor:
        """A host uint8 buffer the copies may target (allocated once, reused)."""
        ...

    def start(self, dst: torch.Tensor, srcs: Sequence[torch.Tensor]) -> object:
        """Begin copying ``srcs`` (1-D uint8) end to end into the start of
        ``dst``; returns a handle for :meth:`wait`."""
        ...

    def wait(self, pending: object) -> None:
        """Return once the copies behind ``pending`` have landed."""
        ...

    def ordered_after(
        self, ready: torch.cuda.Event | None
    ) -> contextlib.AbstractContextManager[None]:
        """Where the codec runs: after the work ``ready`` marks, in the
        copies' order."""
        ...


class CudaCopier:
    """Copies on a stream of their own into pinned host memory.

    :meth:`ordered_after` makes that stream wait for the work the sender's
    caller had queued when it called ``send`` (an event recorded then), and
    runs the codec's kernels on it, so the copies read the finished tensor
    without blocking the caller's stream or the whole device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    @contextlib.contextmanager
    def ordered_after(self, ready: torch.cuda.Event | None) -> Iterator[None]:
        if ready is not None:
            self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            yield

    def start(self, dst: torch.Tensor, srcs: Sequence[torch.Tensor]) -> object:
        with torch.cuda.stream(self.stream):
            offset = 0
            for src in srcs:
                dst[offset : offset + src.numel()].copy_(src, non_blocking=True)
                offset += src.numel()
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def wait(self, pending: object) -> None:
        assert isinstance(pending, torch.cuda.Event)
        pending.synchronize()


class HostStaging:
    """Three reused host buffers of ``chunk_bytes`` and the copies into them
    (see the module docstring)."""

    #: chunks alive at once: the one the link still has to write, the one it
    #: holds, the one being copied
    depth = 3

    def __init__(self, chunk_bytes: int, copier: Copier) -> None:
        self.chunk_bytes = chunk_bytes
        self.copier = copier
        self._buffers: list[torch.Tensor] = []

    def chunks(
        self, parts: Sequence[torch.Tensor], ranges: list[tuple[int, int]]
    ) -> Iterator[list[memoryview]]:
        """For each (start, end) of ``ranges`` (ascending, each at most
        ``chunk_bytes``), the bytes [start, end) of ``parts`` laid end to end,
        as a view of a host buffer. The view stays valid until two more chunks
        have been taken: the copy of the chunk after next is then issued."""
        if any(end - start > self.chunk_bytes for start, end in ranges):
            raise ValueError(f"a chunk exceeds the staging size {self.chunk_bytes}")
        in_flight: deque[tuple[torch.Tensor, int, object]] = deque()

        def issue(i: int) -> None:
            start, end = ranges[i]
            buf = self._buffer(i % self.depth)
            srcs = _slices(parts, start, end)
            in_flight.append((buf, end - start, self.copier.start(buf, srcs)))

        try:
            if ranges:
                issue(0)
            for i in range(len(ranges)):
                if i + 1 < len(ranges):
                    issue(i + 1)  # in flight while the caller writes chunk i - 1
                buf, size, pending = in_flight.popleft()
                self.copier.wait(pending)
                yield [memoryview(buf.numpy())[:size]]
        finally:
            # An abandoned tensor (the link failed mid-send) must not leave a
            # copy landing in a buffer the next tensor is about to use.
            for _, _, pending in in_flight:
                self.copier.wait(pending)

    def _buffer(self, index: int) -> torch.Tensor:
        while len(self._buffers) <= index:
            self._buffers.append(self.copier.buffer(self.chunk_bytes))
        return self._buffers[index]


def device_parts(side: torch.Tensor, payload: torch.Tensor) -> list[torch.Tensor]:
    """An encoded tensor's non-empty buffers, in wire order (side data first)."""
    return [t for t in (side, payload) if t.numel()]


def _slices(parts: Sequence[torch.Tensor], start: int, end: int) -> list[torch.Tensor]:
    """Slices of bytes [start, end) of the parts laid end to end."""
    out, offset = [], 0
    for part in parts:
        lo, hi = max(start, offset), min(end, offset + part.numel())
        if lo < hi:
            out.append(part[lo - offset : hi - offset])
        offset += part.numel()
    return out
