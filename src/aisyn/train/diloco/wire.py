"""The delta on the wire: the link's codecs, and the bytes a ring collective sends."""

from __future__ import annotations

import torch

from aisyn.link.codec import decode_flat, encode_flat, flat_sizes
from aisyn.train.diloco.config import INT8_BLOCK

# --- the delta on the wire ---------------------------------------------------------


#: DiLoCo's precisions as the link's codecs (``link/codec.py``: one codec)
_CODEC = {"fp32": "none", "bf16": "bf16", "fp16": "fp16", "int8": "int8"}


def encode(delta: torch.Tensor, precision: str) -> list[torch.Tensor]:
    """The flat fp32 ``delta`` as what crosses: itself, or the link codec's
    bytes of it -- a half-precision copy, or int8 codes with one fp32 scale
    per ``INT8_BLOCK`` (absmax / 127; a block with a non-finite value decodes
    to NaN, so the receiver sees it)."""
    if precision == "fp32":
        return [delta]
    side, payload = encode_flat(delta, _CODEC[precision], block=INT8_BLOCK)
    return [payload, side] if side.numel() else [payload]


def decode(payload: list[torch.Tensor], precision: str, numel: int) -> torch.Tensor:
    """``encode``'s inverse (up to its rounding), as flat fp32."""
    if precision == "fp32":
        return payload[0].to(torch.float32)
    side = payload[1] if len(payload) > 1 else torch.empty(0, dtype=torch.uint8)
    return decode_flat(side, payload[0], _CODEC[precision], numel, block=INT8_BLOCK)


def payload_bytes(payload: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in payload)


def encoded_bytes(numel: int, precision: str) -> int:
    """``payload_bytes(encode(delta, precision))`` for ``numel`` values,
    without encoding them."""
    return sum(flat_sizes(_CODEC[precision], numel, block=INT8_BLOCK))


def ring_bytes_sent(nbytes: int, centres: int, op: str) -> int:
    """What one centre sends for a ring collective over ``centres`` of a
    payload of ``nbytes`` (its own share): all-reduce 2 (N-1)/N of it,
    all-gather (N-1)/N of everyone's."""
    if centres <= 1:
        return 0
    if op == "all_reduce":
        return round(2 * (centres - 1) / centres * nbytes)
    return (centres - 1) * nbytes
