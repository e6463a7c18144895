"""In-process link pair, for single-process split training and for tests.

With codec ``none`` a tensor is handed over as the (detached) tensor object
itself: no serialisation, no copy, and no autograd graph crosses. The receiver
therefore shares storage with the sender; neither side may modify it in place.
With any other codec every frame takes the real wire path -- serialised,
parsed, validated, reassembled and decoded -- so compression and the protocol
rules behave exactly as over gRPC. Byte counters always report what the
frames would occupy on the wire.
"""

from __future__ import annotations

import dataclasses

import torch

from ._core import LinkCore, _Job
from .base import Link, LinkOptions, PeerHello
from .codec import effective_codec
from .errors import (
    FrameError,
    LinkError,
    PeerAbortedError,
    PeerLostError,
    SessionAbortedError,
)
from .frames import PROTOCOL_VERSION, FrameKey, parse_frame, tensor_wire_size

__all__ = ["IN_PROCESS", "memory_pair"]

#: the identity each end of a memory pair has: the peer is this very process
IN_PROCESS = "in-process"


class MemoryLink(LinkCore):
    """One end of :func:`memory_pair`. Frames are delivered on the sender's
    background thread straight into the peer's mailbox."""

    _peer: MemoryLink

    def _write(self, frame: bytes) -> int:
        self._peer._receive(frame)
        return len(frame)

    def _transmit_tensor(self, job: _Job) -> None:
        assert job.key is not None and job.tensor is not None
        if effective_codec(job.codec, job.tensor.dtype) != "none":
            super()._transmit_tensor(job)
            return
        size = tensor_wire_size(job.key, job.tensor, self._opts.chunk_bytes)
        self._sent += size
        self._peer._receive_tensor(job.key, job.tensor, size)

    def _receive(self, frame: bytes) -> None:
        try:
            self._on_frame(parse_frame(frame))
        except FrameError as exc:
            self._fail(exc, notify_peer=True)

    def _receive_tensor(self, key: FrameKey, tensor: torch.Tensor, nbytes: int) -> None:
        self._received += nbytes
        try:
            self._admit(key, tensor.numel() * tensor.element_size())
            self._deliver(key, tensor)
        except FrameError as exc:
            self._fail(exc, notify_peer=True)

    def _end_writes(self) -> None:
        pass

    def _teardown(self, exc: LinkError, notify_peer: bool) -> None:
        # Mirror what the gRPC link's peer would see: our reason if we chose to
        # tell it, otherwise just a dead stream.
        if isinstance(exc, SessionAbortedError):
            self._peer._fail(
                PeerAbortedError(f"peer aborted the session: {exc}"), notify_peer=False
            )
        elif notify_peer:
            self._peer._fail(
                FrameError(f"peer rejected the session: {exc}"), notify_peer=False
            )
        else:
            self._peer._fail(
                PeerLostError(f"peer link failed: {exc}"), notify_peer=False
            )

    def _shutdown(self, graceful: bool, timeout: float) -> None:
        if not graceful:
            self._peer._fail(PeerLostError("peer closed the link"), notify_peer=False)


def memory_pair(
    codec: str = "none", *, options: LinkOptions | None = None
) -> tuple[Link, Link]:
    """Two connected in-process links (party A's end, party B's end).

    ``codec`` is the default codec of both ends (overrides ``options.codec``).
    """
    opts = dataclasses.replace(options or LinkOptions(), codec=codec)
    a = MemoryLink(opts, "memory[A]", PeerHello("B", PROTOCOL_VERSION, "", IN_PROCESS))
    b = MemoryLink(opts, "memory[B]", PeerHello("A", PROTOCOL_VERSION, "", IN_PROCESS))
    a._peer, b._peer = b, a
    a._start()
    b._start()
    return a, b
