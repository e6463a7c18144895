"""A received tensor, put together from its chunks (:class:`TensorAssembler`:
sizes, order, the memory budget) into buffers reused once the caller has
dropped the tensors it was given (:class:`ReceivePool`). A small state
machine, no threads, no I/O: unit-testable without a transport."""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .base import MAX_CHUNK_BYTES
from .codec import DTYPES, Encoded, decode, effective_codec, wire_sizes
from .errors import (
    FrameOrderError,
    FrameTooLargeError,
    MalformedFrameError,
)
from .frames import MAX_DIMS, TENSOR, Deferred, FrameKey, key_problem
from .proto import tensor_link_pb2 as pb


class ReceivePool:
    """Recycles the buffers of received tensors once the application has let
    go of them.

    Every received tensor is the caller's own, but a fresh multi-MiB buffer
    per tensor is a fresh mapping whose pages fault in as the data lands:
    that alone cost a third of a TLS socket's rate on the 2-core test box
    (``bench/link_throughput.py``). Activations and gradients come in the same
    few sizes every step, so a buffer of the size wanted whose storage nobody
    else references any more (the storage's use count says so: any tensor,
    view, numpy array or autograd record still using it counts) is handed out
    again instead. Per size the buffers rotate oldest first (the oldest is
    the likeliest to be free) and only a few are tried, so a caller holding
    many costs nothing. Buffers under ``min_bytes`` are left to the
    allocator; the pool keeps at most ``max_bytes``. One receiving thread
    uses it.
    """

    #: buffers of one size tried before a new one is allocated
    TRIES = 4

    def __init__(self, max_bytes: int, min_bytes: int = 64 * 1024) -> None:
        self._max = max_bytes
        self._min = min_bytes
        self._by_size: dict[int, collections.deque[torch.Tensor]] = {}
        self._bytes = 0

    def take(self, nbytes: int) -> torch.Tensor:
        if nbytes < self._min or nbytes > self._max:
            return torch.empty(nbytes, dtype=torch.uint8)
        ring = self._by_size.setdefault(nbytes, collections.deque())
        for _ in range(min(self.TRIES, len(ring))):
            buffer = ring.popleft()
            ring.append(buffer)
            if _unused(buffer):
                return buffer
        if self._bytes + nbytes > self._max:
            self._evict(nbytes)
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        if self._bytes + nbytes <= self._max:
            ring.append(buffer)
            self._bytes += nbytes
        return buffer

    def _evict(self, nbytes: int) -> None:
        """Drop unused buffers (other sizes first) until ``nbytes`` fit."""
        for size in sorted(self._by_size, key=lambda k: k == nbytes):
            ring = self._by_size[size]
            for buffer in [b for b in ring if _unused(b)]:
                ring.remove(buffer)
                self._bytes -= size
                if self._bytes + nbytes <= self._max:
                    return

    @property
    def pooled_bytes(self) -> int:
        return self._bytes


def _unused(buffer: torch.Tensor) -> bool:
    # The pool's own tensor and the temporary storage object asked: 2.
    return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata) <= 2


@dataclass(slots=True)
class _Partial:
    key: FrameKey
    header: tuple[object, ...]
    codec: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    buffer: torch.Tensor
    view: np.ndarray
    num_chunks: int
    next_index: int = 0
    filled: int = 0


def _header(chunk: pb.TensorChunk) -> tuple[object, ...]:
    """Everything that must be identical across the chunks of one tensor."""
    return (
        chunk.tag,
        chunk.step,
        chunk.micro,
        chunk.dtype,
        tuple(chunk.shape),
        chunk.codec,
        chunk.num_chunks,
        chunk.total_bytes,
        chunk.side_bytes,
    )


class TensorAssembler:
    """Reassembles and validates the chunks of one tensor at a time.

    Chunks of one tensor arrive back to back (the sender emits them from one
    thread onto one ordered stream), so any other frame in between means the
    tensor was truncated. ``admit(key, nbytes)`` is called once per tensor,
    before its buffer is allocated, so ordering and memory-budget checks can
    reject it early; it raises FrameError to refuse.
    """

    def __init__(
        self,
        max_tensor_bytes: int,
        admit: Callable[[FrameKey, int], None],
        pool: ReceivePool | None = None,
    ) -> None:
        self._max = max_tensor_bytes
        self._admit = admit
        self._pool = pool or ReceivePool(0)
        self._cur: _Partial | None = None

    @property
    def in_progress(self) -> str | None:
        """Description of a partially received tensor, or None."""
        return None if self._cur is None else self._describe(self._cur)

    def add(
        self, chunk: pb.TensorChunk, data: memoryview | bytes | Deferred | None = None
    ) -> tuple[FrameKey, torch.Tensor] | None:
        """Consume one chunk whose data is ``data`` (default ``chunk.data``);
        returns (key, tensor) when the tensor is complete. ``Deferred`` data is
        read into the tensor's buffer only once the chunk passed every check."""
        if data is None:
            data = chunk.data  # each access of a bytes field copies: do it once
        n = len(data)
        if n > MAX_CHUNK_BYTES:
            raise FrameTooLargeError(
                f"chunk of {n} bytes exceeds the {MAX_CHUNK_BYTES} limit"
            )
        cur = self._cur
        if cur is None:
            if chunk.chunk_index != 0:
                raise FrameOrderError(
                    f"chunk {chunk.chunk_index} of tensor {chunk.tag!r} step "
                    f"{chunk.step} micro {chunk.micro} arrived without chunk 0"
                )
            cur = self._cur = self._start(chunk)
        elif _header(chunk) != cur.header:
            self._cur = None
            if chunk.chunk_index == 0:
                raise MalformedFrameError(
                    f"{self._describe(cur)} truncated: next tensor began first"
                )
            raise MalformedFrameError(
                f"chunk {chunk.chunk_index} of {cur.key} has a header that differs "
                "from chunk 0"
            )
        elif chunk.chunk_index != cur.next_index:
            self._cur = None
            raise FrameOrderError(
                f"chunk {chunk.chunk_index} of {cur.key} arrived, "
                f"expected chunk {cur.next_index}"
            )
        if cur.filled + n > cur.buffer.numel():
            self._cur = None
            raise MalformedFrameError(
                f"{cur.key}: chunks carry more than the {cur.buffer.numel()} bytes "
                "announced"
            )
        if isinstance(data, Deferred):
            data.read_into(memoryview(cur.view[cur.filled : cur.filled + n]))
        else:
            cur.view[cur.filled : cur.filled + n] = np.frombuffer(data, np.uint8)
        cur.filled += n
        cur.next_index += 1
        if cur.next_index < cur.num_chunks:
            return None
        self._cur = None
        return cur.key, self._finish(cur)

    def reset(self) -> None:
        self._cur = None

    @staticmethod
    def _describe(cur: _Partial) -> str:
        return f"{cur.key} (got {cur.next_index} of {cur.num_chunks} chunks)"

    def _start(self, chunk: pb.TensorChunk) -> _Partial:
        problem = key_problem(chunk.tag, chunk.step, chunk.micro)
        if problem:
            raise MalformedFrameError(f"bad TENSOR frame: {problem}")
        key = FrameKey(TENSOR, chunk.tag, chunk.step, chunk.micro)
        dtype = DTYPES.get(chunk.dtype)
        if dtype is None:
            raise MalformedFrameError(f"{key}: unknown dtype {chunk.dtype!r}")
        shape = tuple(chunk.shape)
        if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
            raise MalformedFrameError(f"{key}: invalid shape {list(shape)}")
        try:
            if effective_codec(chunk.codec, dtype) != chunk.codec:
                raise ValueError(f"codec {chunk.codec!r} is not used for {chunk.dtype}")
            side, payload = wire_sizes(chunk.codec, shape, dtype)
        except ValueError as exc:
            raise MalformedFrameError(f"{key}: {exc}") from None
        total = side + payload
        decoded = math.prod(shape) * dtype.itemsize
        if max(total, decoded) > self._max:
            raise FrameTooLargeError(
                f"{key}: {max(total, decoded)} bytes exceeds the {self._max}-byte "
                "tensor limit"
            )
        if chunk.total_bytes != total or chunk.side_bytes != side:
            raise MalformedFrameError(
                f"{key}: header announces {chunk.side_bytes}+"
                f"{chunk.total_bytes - chunk.side_bytes} bytes but {chunk.codec} "
                f"{chunk.dtype}{list(shape)} needs {side}+{payload}"
            )
        min_chunks = max(1, -(-total // MAX_CHUNK_BYTES))
        if not min_chunks <= chunk.num_chunks <= max(1, total):
            raise MalformedFrameError(
                f"{key}: {chunk.num_chunks} chunks cannot carry {total} bytes"
            )
        self._admit(key, decoded)
        buffer = self._pool.take(total)
        return _Partial(
            key=key,
            header=_header(chunk),
            codec=chunk.codec,
            dtype=dtype,
            shape=shape,
            buffer=buffer,
            view=buffer.numpy(),
            num_chunks=chunk.num_chunks,
        )

    @staticmethod
    def _finish(cur: _Partial) -> torch.Tensor:
        if cur.filled != cur.buffer.numel():
            raise MalformedFrameError(
                f"{cur.key} truncated: {cur.filled} of {cur.buffer.numel()} bytes"
            )
        side = wire_sizes(cur.codec, cur.shape, cur.dtype)[0]
        enc = Encoded(
            cur.codec, cur.dtype, cur.shape, cur.buffer[:side], cur.buffer[side:]
        )
        try:
            return decode(enc)
        except ValueError as exc:
            raise MalformedFrameError(f"{cur.key}: {exc}") from None
