"""Codecs: exact round trips, error bounds, sizes, and decode validation."""

from __future__ import annotations

import pytest
import torch

from aisyn.link.codec import CODECS, DTYPES, Encoded, decode, encode, wire_sizes


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (2, 3, 65)])
def test_none_is_exact_for_every_dtype(dtype: torch.dtype, shape: tuple[int, ...]):
    x = (torch.randn(shape) * 50).to(dtype)
    y = decode(encode(x, "none"))
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, x)


def test_none_payload_is_a_view_of_the_tensor():
    x = torch.randn(4, 5)
    enc = encode(x, "none")
    assert enc.payload.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert enc.nbytes == x.numel() * 4


def test_non_contiguous_and_autograd_inputs():
    base = torch.randn(6, 8, requires_grad=True)
    x = (base * 2).t()  # non-contiguous, part of a graph
    before = x.detach().clone()
    for codec in CODECS:
        y = decode(encode(x, codec))
        assert y.shape == x.shape and not y.requires_grad
        assert torch.allclose(y, before, rtol=0.02, atol=0.05)
    assert torch.equal(x.detach(), before), "encode must not modify its input"


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("n", [1, 63, 64, 65, 4096, 100_003])
def test_int8_error_on_gaussian_data(n: int):
    torch.manual_seed(n)
    x = torch.randn(n)
    enc = encode(x, "int8")
    err = relative_l2(decode(enc), x)
    print(f"int8 relative L2 error, n={n}: {err:.4%}")
    assert err < 0.01
    side, payload = wire_sizes("int8", x.shape, x.dtype)
    assert (enc.side.numel(), enc.payload.numel()) == (side, payload)
    assert payload == n and side == 4 * -(-n // 64)


def test_int8_outlier_only_affects_its_block():
    x = torch.randn(64 * 4)
    x[10] = 1e4
    y = decode(encode(x, "int8"))
    assert relative_l2(y[64:], x[64:]) < 0.01


def test_int8_zero_nonfinite_and_tiny_blocks():
    x = torch.zeros(64 * 4)
    x[64] = float("inf")
    x[128 + 3] = float("nan")
    x[192:] = 1e-39  # subnormal: 127 / absmax overflows
    y = decode(encode(x, "int8"))
    assert torch.equal(y[:64], torch.zeros(64)), "all-zero block decodes to zero"
    assert torch.isnan(y[64:192]).all(), "inf/NaN poison their block so checks fire"
    assert torch.isfinite(y[192:]).all() and y[192:].abs().max() < 1e-30


@pytest.mark.parametrize(
    ("codec", "dtype", "bound"),
    [
        ("fp16", torch.float32, 1e-3),
        ("bf16", torch.float32, 8e-3),
        ("int8", torch.bfloat16, 0.01),
        ("int8", torch.float16, 0.01),
        ("fp16", torch.float64, 1e-3),
    ],
)
def test_lossy_codecs_restore_dtype_and_bound_error(codec, dtype, bound):
    x = torch.randn(3, 1000).to(dtype)
    enc = encode(x, codec)
    y = decode(enc)
    assert y.dtype == dtype and y.shape == x.shape
    assert relative_l2(y, x) < bound
    assert enc.nbytes < x.numel() * x.element_size() or dtype is torch.float16


def test_lossy_codec_skips_non_float_tensors():
    ids = torch.randint(0, 50_000, (4, 7))
    enc = encode(ids, "int8")
    assert enc.codec == "none"
    assert torch.equal(decode(enc), ids)


def test_compression_ratios():
    x = torch.randn(8, 128, 1280)
    raw = encode(x, "none").nbytes
    assert encode(x, "fp16").nbytes == raw // 2
    assert encode(x, "bf16").nbytes == raw // 2
    assert encode(x, "int8").nbytes == raw // 4 + raw // 64


def test_decode_rejects_wrong_sizes_and_bool_garbage():
    enc = encode(torch.randn(10), "int8")
    with pytest.raises(ValueError, match="needs 4\\+10 bytes"):
        decode(Encoded("int8", torch.float32, (10,), enc.side, enc.payload[:-1]))
    garbage = torch.tensor([0, 1, 7], dtype=torch.uint8)
    with pytest.raises(ValueError, match="bool"):
        decode(Encoded("none", torch.bool, (3,), garbage[:0], garbage))


def test_unknown_codec_and_dtype():
    with pytest.raises(ValueError, match="unknown codec"):
        encode(torch.zeros(2), "zstd")
    with pytest.raises(ValueError, match="cannot be sent"):
        encode(torch.zeros(2, dtype=torch.complex64))


def test_int8_multi_pass_matches_single_pass(monkeypatch):
    """Slabbing is an implementation detail: results must not depend on it."""
    from aisyn.link.codec import _CODECS

    x = torch.randn(64 * 1000 + 17).to(torch.bfloat16)
    one = encode(x, "int8")
    monkeypatch.setattr(_CODECS["int8"], "min_slab", 64 * 3)  # many passes
    many = encode(x, "int8")
    assert torch.equal(one.side, many.side) and torch.equal(one.payload, many.payload)
    assert torch.equal(decode(many), decode(one))


def test_flat_int8_takes_a_block_size_and_checks_the_bytes():
    """DiLoCo's deltas go through the link's int8 codec with larger blocks:
    one scale per block, the same bound, and buffers of the wrong size are
    refused rather than read past."""
    from aisyn.link.codec import decode_flat, encode_flat, flat_sizes

    x = torch.randn(3 * 4096 + 17, generator=torch.Generator().manual_seed(0))
    side, payload = encode_flat(x, "int8", block=4096)
    assert (side.numel(), payload.numel()) == flat_sizes("int8", x.numel(), block=4096)
    assert side.numel() == 4 * 4 and payload.numel() == x.numel()
    back = decode_flat(side, payload, "int8", x.numel(), block=4096)
    blocks = torch.nn.functional.pad(x, (0, 4096 - 17)).view(4, -1)
    bound = (blocks.abs().amax(dim=1) / 254).repeat_interleave(4096)[: x.numel()]
    assert ((back - x).abs() <= bound * 1.0001).all()
    # the default block is the link's 64: other bytes for the same values
    assert flat_sizes("int8", x.numel()) == (4 * -(-x.numel() // 64), x.numel())
    with pytest.raises(ValueError, match="needs 16\\+12305 bytes, got 16\\+12304"):
        decode_flat(side, payload[:-1], "int8", x.numel(), block=4096)
