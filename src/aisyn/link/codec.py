"""Tensor codecs: how a tensor becomes bytes on the wire and back.

A codec turns a tensor into two byte buffers, *side data* (e.g. int8 scales)
and *payload*, 1-D uint8 tensors: on the CPU, so the frame layer can hand
their memory to the socket without another copy, or with ``to_host=False`` on
the tensor's own device, so a GPU tensor is encoded where it lives and only
its wire bytes cross to the host, chunk by chunk (``link/staging.py``).
Decoding takes the same two buffers (typically views into one receive buffer)
plus the dtype/shape from the frame header, and returns a tensor of the
original dtype and shape.

=======  =========================================  ===========================
codec    wire bytes per element (fp32 source)       error
=======  =========================================  ===========================
none     itemsize of the tensor (4)                 exact
fp16     2                                          ~5e-4 relative; |x|>65504
                                                    becomes inf
bf16     2                                          ~4e-3 relative, full range
int8     1 + 4/64 (fp32 absmax scale per 64 values) ~0.6% relative L2, Gaussian
=======  =========================================  ===========================

Lossy codecs only apply to floating-point tensors; other dtypes (masks, ids)
are always sent with ``none`` and the frame records that.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "CODECS",
    "CodecOverflowError",
    "DTYPES",
    "Encoded",
    "decode",
    "dtype_name",
    "encode",
    "wire_sizes",
]

#: dtypes the link can carry, by their wire name.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
_EMPTY = torch.empty(0, dtype=torch.uint8)


class CodecOverflowError(ValueError):
    """A finite value does not fit the codec's wire type (fp16 beyond 65504)."""


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of ``dtype``; ValueError if the link cannot carry it."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} cannot be sent (supported: {', '.join(DTYPES)})"
        ) from None


@dataclass(frozen=True, slots=True)
class Encoded:
    """A tensor in wire form. ``side`` and ``payload`` are 1-D uint8 tensors,
    on the CPU unless :func:`encode` was asked to leave them on the device."""

    codec: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    side: torch.Tensor
    payload: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.side.numel() + self.payload.numel()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret a contiguous CPU tensor as flat uint8 (no copy)."""
    return t.reshape(-1).view(torch.uint8)


class _Codec(ABC):
    name: str

    @abstractmethod
    def sizes(self, numel: int, dtype: torch.dtype) -> tuple[int, int]:
        """Exact (side, payload) byte counts for a tensor of ``numel`` elements."""

    @abstractmethod
    def encode(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat contiguous tensor -> (side, payload) uint8 tensors on its device."""

    @abstractmethod
    def decode(
        self, side: torch.Tensor, payload: torch.Tensor, numel: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Inverse of :meth:`encode`; returns a flat tensor of ``dtype``."""


class _Raw(_Codec):
    name = "none"

    def sizes(self, numel: int, dtype: torch.dtype) -> tuple[int, int]:
        return 0, numel * dtype.itemsize

    def encode(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _EMPTY, _as_bytes(flat)

    def decode(
        self, side: torch.Tensor, payload: torch.Tensor, numel: int, dtype: torch.dtype
    ) -> torch.Tensor:
        if dtype is torch.bool and numel and int(payload.max()) > 1:
            # Any byte other than 0/1 is undefined behaviour for torch.bool.
            raise ValueError("bool tensor contains bytes other than 0 and 1")
        return payload.view(dtype)


class _Cast(_Codec):
    """Send floating tensors as a narrower float type."""

    def __init__(self, name: str, wire_dtype: torch.dtype) -> None:
        self.name = name
        self._wire = wire_dtype

    def sizes(self, numel: int, dtype: torch.dtype) -> tuple[int, int]:
        return 0, numel * self._wire.itemsize

    def encode(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # On the tensor's device: a GPU tensor then moves half the bytes to the host.
        wire = flat.to(self._wire)
        if self._wire is torch.float16 and not bool(torch.isfinite(wire).all()):
            # Name the overflow here: the peer would only see inf, and finite
            # values turned inf must never pass for a peer's non-finite numbers.
            if bool(torch.isfinite(flat).all()):
                biggest = float(flat.abs().max())
                raise CodecOverflowError(
                    f"fp16 codec overflow: values up to {biggest:.4g} exceed "
                    f"float16's range (65504); use --compress bf16 or none"
                )
        return _EMPTY, _as_bytes(wire)

    def decode(
        self, side: torch.Tensor, payload: torch.Tensor, numel: int, dtype: torch.dtype
    ) -> torch.Tensor:
        return payload.view(self._wire).to(dtype)


class _Int8Blockwise(_Codec):
    """Absmax int8 quantisation in blocks of 64 consecutive values.

    Each block stores ``q = round(x * 127 / absmax)`` and one fp32 scale
    ``absmax / 127``; fp32 rather than fp16 scales because gradients routinely
    have absmax below fp16's normal range. Per-block scales keep one outlier
    from flattening the resolution of the whole tensor. A block containing
    inf/NaN decodes to all-NaN, so loss-scaler overflow checks downstream still
    fire instead of training on silently zeroed gradients.
    """

    name = "int8"
    #: The tensor is processed in at most ``max_passes`` slabs of at least
    #: ``min_slab`` values, through one reused fp32 scratch: temporaries stay
    #: at ~1/4 of the tensor instead of several tensor-sized copies, while the
    #: number of torch ops -- each a parallel region that can stall for a
    #: scheduler tick when training threads occupy the cores -- stays small.
    min_slab = 1 << 20
    max_passes = 4

    def __init__(self, block: int = 64) -> None:
        #: values per scale: 64 on the link (cut tensors: one outlier costs
        #: little); DiLoCo's deltas take larger blocks (``train/diloco/wire.py``)
        self.block = block

    def sizes(self, numel: int, dtype: torch.dtype) -> tuple[int, int]:
        return 4 * -(-numel // self.block), numel

    def _slabs(self, n: int) -> tuple[int, list[tuple[int, int, int]]]:
        """Slab size and (start, end, rows) passes over n values; the ragged
        tail is its own short block rather than padding (copying) the input."""
        b, full = self.block, n - n % self.block
        slab = max(self.min_slab, -(-n // (self.max_passes * b)) * b)
        passes = [(s, min(full, s + slab), 0) for s in range(0, full, slab)]
        if full < n:
            passes.append((full, n, 1))
        return slab, [(s, e, rows or (e - s) // b) for s, e, rows in passes]

    def encode(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, b, dev = flat.numel(), self.block, flat.device
        scale = torch.empty(-(-n // b), dtype=torch.float32, device=dev)
        q = torch.empty(n, dtype=torch.int8, device=dev)
        slab, passes = self._slabs(n)
        scratch = torch.empty(min(n, slab), dtype=torch.float32, device=dev)
        for start, end, rows in passes:
            y = scratch[: end - start].view(rows, -1)
            y.copy_(flat[start:end].view(rows, -1))  # also casts bf16/fp16 to fp32
            first = start // b
            self._quantise(y, scale[first : first + rows])
            q[start:end].view(rows, -1).copy_(y)
        return _as_bytes(scale), _as_bytes(q)

    @staticmethod
    def _quantise(y: torch.Tensor, scale: torch.Tensor) -> None:
        """Blocks in the rows of fp32 ``y`` -> integer-valued y; fills ``scale``."""
        lo, hi = torch.aminmax(y, dim=1)  # propagates NaN
        absmax = torch.maximum(hi, lo.neg_())
        torch.div(absmax, 127.0, out=scale)
        inv = 127.0 / absmax
        # Blocks that are all zero, hold inf/NaN, or are so small that 127/absmax
        # overflows get q = 0; their scale (0, inf/NaN, tiny) decodes them to
        # 0, NaN and ~0 respectively.
        usable = torch.isfinite(inv) & (inv > 0)
        y.mul_(torch.where(usable, inv, torch.zeros_like(inv))[:, None])
        if not bool(usable.all()):
            # inf * 0 = NaN, and casting NaN to int8 is undefined.
            y.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        y.round_()

    def decode(
        self, side: torch.Tensor, payload: torch.Tensor, numel: int, dtype: torch.dtype
    ) -> torch.Tensor:
        scale, q, b = side.view(torch.float32), payload.view(torch.int8), self.block
        out = torch.empty(numel, dtype=dtype)
        slab, passes = self._slabs(numel)
        scratch = None if dtype is torch.float32 else torch.empty(min(numel, slab))
        for start, end, rows in passes:
            target = out[start:end].view(rows, -1)
            y = target if scratch is None else scratch[: end - start].view(rows, -1)
            y.copy_(q[start:end].view(rows, -1))
            y.mul_(scale[start // b : start // b + rows, None])
            if y is not target:
                target.copy_(y)
        return out


_CODECS: dict[str, _Codec] = {
    c.name: c
    for c in (
        _Raw(),
        _Cast("fp16", torch.float16),
        _Cast("bf16", torch.bfloat16),
        _Int8Blockwise(),
    )
}
#: Names of the available codecs.
CODECS: tuple[str, ...] = tuple(_CODECS)


@functools.cache
def _int8(block: int) -> _Int8Blockwise:
    if block < 1:
        raise ValueError(f"int8 block must be >= 1, got {block}")
    return _Int8Blockwise(block)


def _flat_codec(name: str, block: int | None) -> _Codec:
    codec = _codec(name)
    return _int8(block) if name == "int8" and block is not None else codec


def encode_flat(
    flat: torch.Tensor, codec: str, *, block: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(side, payload) uint8 buffers of a flat float tensor, on its device:
    no frame header (the caller knows the length and dtype), as a collective
    moves them. ``block``: the int8 codec's values per scale (default 64)."""
    return _flat_codec(codec, block).encode(flat.reshape(-1))


def decode_flat(
    side: torch.Tensor,
    payload: torch.Tensor,
    codec: str,
    numel: int,
    dtype: torch.dtype = torch.float32,
    *,
    block: int | None = None,
) -> torch.Tensor:
    """``encode_flat``'s inverse (up to its rounding), as a flat tensor."""
    c = _flat_codec(codec, block)
    side_n, payload_n = c.sizes(numel, dtype)
    if side.numel() != side_n or payload.numel() != payload_n:
        raise ValueError(
            f"{codec} of {numel} values needs {side_n}+{payload_n} bytes, got "
            f"{side.numel()}+{payload.numel()}"
        )
    return c.decode(side, payload, numel, dtype)


def flat_sizes(
    codec: str, numel: int, dtype: torch.dtype = torch.float32, *, block=None
) -> tuple[int, int]:
    """(side, payload) byte counts ``encode_flat`` produces."""
    return _flat_codec(codec, block).sizes(numel, dtype)


def _codec(name: str) -> _Codec:
    try:
        return _CODECS[name]
    except KeyError:
        raise ValueError(
            f"unknown codec {name!r} (known: {', '.join(CODECS)})"
        ) from None


def effective_codec(codec: str, dtype: torch.dtype) -> str:
    """The codec actually used for ``dtype``: lossy codecs skip non-float tensors."""
    _codec(codec)
    return codec if dtype.is_floating_point else "none"


def encode(
    tensor: torch.Tensor, codec: str = "none", *, to_host: bool = True
) -> Encoded:
    """Encode ``tensor`` (any device, any layout) without modifying it.

    The buffers are CPU tensors; with ``to_host=False`` they stay on the
    tensor's device (where the codec ran), for a caller that moves them to
    the host itself. For ``none`` on a contiguous tensor the payload is a
    view of the tensor's own memory: the caller must not modify the tensor
    until the payload has been consumed.
    """
    dtype_name(tensor.dtype)  # reject unsupported dtypes early
    if tensor.layout is not torch.strided:
        raise ValueError(f"only dense tensors can be sent, got layout {tensor.layout}")
    name = effective_codec(codec, tensor.dtype)
    flat = tensor.detach().reshape(-1)  # copies only if not contiguous
    side, payload = _CODECS[name].encode(flat)
    if to_host:  # no-ops on the CPU
        side, payload = side.cpu(), payload.cpu()
    return Encoded(name, tensor.dtype, tuple(tensor.shape), side, payload)


def wire_sizes(codec: str, shape: Sequence[int], dtype: torch.dtype) -> tuple[int, int]:
    """(side, payload) byte counts that ``encode`` produces for this tensor."""
    return _codec(codec).sizes(_numel(shape), dtype)


def decode(enc: Encoded) -> torch.Tensor:
    """Rebuild the tensor; ValueError if the buffers do not match the header.

    The result may be a view of ``enc.payload`` (codec ``none``), so pass
    buffers the caller owns.
    """
    codec = _codec(enc.codec)
    numel = _numel(enc.shape)
    side_n, payload_n = codec.sizes(numel, enc.dtype)
    if enc.side.numel() != side_n or enc.payload.numel() != payload_n:
        raise ValueError(
            f"{enc.codec} {_NAMES.get(enc.dtype, enc.dtype)}{list(enc.shape)} needs "
            f"{side_n}+{payload_n} bytes, got {enc.side.numel()}+{enc.payload.numel()}"
        )
    for buf in (enc.side, enc.payload):
        if buf.dtype is not torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
            raise ValueError("encoded buffers must be contiguous 1-D uint8 tensors")
    return codec.decode(enc.side, enc.payload, numel, enc.dtype).view(enc.shape)


def _numel(shape: Sequence[int]) -> int:
    if any(dim < 0 for dim in shape):
        raise ValueError(f"negative dimension in shape {list(shape)}")
    return math.prod(shape)
