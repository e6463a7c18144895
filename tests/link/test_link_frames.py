"""Frame layer: hand-built wire format and the reassembler's validation rules."""

from __future__ import annotations

import random

import pytest
import torch

from aisyn.link.assembly import TensorAssembler
from aisyn.link.codec import encode
from aisyn.link.errors import (
    FrameOrderError,
    FrameTooLargeError,
    HandshakeError,
    MalformedFrameError,
)
from aisyn.link.frames import (
    MAX_MESSAGE_BYTES,
    TENSOR,
    FrameKey,
    check_hello,
    hello_frame,
    parse_frame,
    tensor_frames,
    tensor_wire_size,
)
from aisyn.link.proto import tensor_link_pb2 as pb

KEY = FrameKey(TENSOR, "act", 3, 1)


def chunks_of(x: torch.Tensor, codec: str = "none", chunk: int = 1000):
    frames = tensor_frames(KEY, encode(x, codec), chunk)
    return [pb.Frame.FromString(f).tensor for f in frames]


def assembler(max_bytes: int = 1 << 30) -> tuple[TensorAssembler, list]:
    admitted: list = []
    return TensorAssembler(max_bytes, lambda k, n: admitted.append((k, n))), admitted


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_hand_encoded_frames_are_standard_protobuf(codec):
    x = torch.randn(5, 130)
    enc = encode(x, codec)
    raw = list(tensor_frames(KEY, enc, 1000))
    stream = b"".join(bytes(t.numpy()) for t in (enc.side, enc.payload))
    assert len(raw) == -(-len(stream) // 1000)
    for i, frame_bytes in enumerate(raw):
        frame = pb.Frame.FromString(frame_bytes)
        c = frame.tensor
        expected = pb.Frame(
            tensor=pb.TensorChunk(
                tag="act",
                step=3,
                micro=1,
                dtype="float32",
                shape=[5, 130],
                codec=codec,
                chunk_index=i,
                num_chunks=len(raw),
                total_bytes=len(stream),
                side_bytes=enc.side.numel(),
                data=stream[i * 1000 : (i + 1) * 1000],
            )
        )
        assert frame == expected
        assert len(c.data) <= 1000
    assert sum(map(len, raw)) == tensor_wire_size(KEY, x, 1000) or codec != "none"


def test_full_size_chunk_fits_grpc_message_limit():
    x = torch.zeros(2 * 1024 * 1024)  # 8 MiB -> two 4 MiB chunks
    frames = list(tensor_frames(KEY, encode(x), 4 * 1024 * 1024))
    assert len(frames) == 2
    assert all(len(f) <= MAX_MESSAGE_BYTES for f in frames)


@pytest.mark.parametrize("shape", [(), (0,), (3, 4)])
def test_assembler_round_trip(shape):
    x = torch.randn(shape)
    asm, admitted = assembler()
    results = [asm.add(c) for c in chunks_of(x, chunk=7)]
    assert all(r is None for r in results[:-1])
    key, y = results[-1]
    assert key == KEY and torch.equal(y, x)
    assert admitted == [(KEY, x.numel() * 4)]
    assert asm.in_progress is None


def mutate(chunk: pb.TensorChunk, **fields) -> pb.TensorChunk:
    c = pb.TensorChunk()
    c.CopyFrom(chunk)
    for name, value in fields.items():
        if name == "shape":
            del c.shape[:]
            c.shape.extend(value)
        else:
            setattr(c, name, value)
    return c


BAD_FIRST_CHUNKS = [
    ({"dtype": "complex64"}, MalformedFrameError, "unknown dtype"),
    ({"codec": "zstd"}, MalformedFrameError, "unknown codec"),
    ({"shape": [10, 11]}, MalformedFrameError, "needs 0\\+440"),
    ({"shape": [-1, 10]}, MalformedFrameError, "invalid shape"),
    ({"shape": [1] * 9}, MalformedFrameError, "invalid shape"),
    ({"total_bytes": 12}, MalformedFrameError, "header announces"),
    ({"side_bytes": 4}, MalformedFrameError, "header announces"),
    ({"num_chunks": 0}, MalformedFrameError, "chunks cannot carry"),
    ({"num_chunks": 10_000}, MalformedFrameError, "chunks cannot carry"),
    ({"tag": "bad tag!"}, MalformedFrameError, "tag"),
    ({"step": -5}, MalformedFrameError, "step"),
    ({"micro": -1}, MalformedFrameError, "micro"),
    ({"chunk_index": 1}, FrameOrderError, "without chunk 0"),
]


@pytest.mark.parametrize(("fields", "exc", "match"), BAD_FIRST_CHUNKS)
def test_assembler_rejects_bad_headers(fields, exc, match):
    first = chunks_of(torch.randn(10, 10), chunk=100)[0]
    asm, admitted = assembler()
    with pytest.raises(exc, match=match):
        asm.add(mutate(first, **fields))
    assert admitted == [], "nothing may be admitted or allocated for a bad header"


def test_assembler_rejects_oversized_tensor_before_allocating():
    first = chunks_of(torch.randn(10, 10), chunk=100)[0]
    asm, admitted = assembler(max_bytes=399)
    with pytest.raises(FrameTooLargeError, match="399-byte tensor limit"):
        asm.add(first)
    assert admitted == []


def test_assembler_rejects_oversized_chunk():
    first = chunks_of(torch.randn(10, 10), chunk=100)[0]
    asm, _ = assembler()
    with pytest.raises(FrameTooLargeError, match="exceeds"):
        asm.add(mutate(first, data=b"\0" * (4 * 1024 * 1024 + 1)))


def test_assembler_rejects_out_of_order_inconsistent_and_overlong_chunks():
    chunks = chunks_of(torch.randn(10, 10), chunk=100)  # 4 chunks
    asm, _ = assembler()
    asm.add(chunks[0])
    with pytest.raises(FrameOrderError, match="expected chunk 1"):
        asm.add(chunks[2])

    asm, _ = assembler()
    asm.add(chunks[0])
    with pytest.raises(MalformedFrameError, match="differs from chunk 0"):
        asm.add(mutate(chunks[1], step=4))

    asm, _ = assembler()
    asm.add(chunks[0])
    assert "got 1 of 4 chunks" in asm.in_progress
    with pytest.raises(MalformedFrameError, match="truncated: next tensor began"):
        asm.add(mutate(chunks[0], micro=2))

    asm, _ = assembler()
    asm.add(chunks[0])
    with pytest.raises(MalformedFrameError, match="more than the 400 bytes"):
        asm.add(mutate(chunks[1], data=b"\0" * 400))


def test_assembler_rejects_short_final_chunk():
    chunks = chunks_of(torch.randn(10, 10), chunk=100)
    asm, _ = assembler()
    for c in chunks[:-1]:
        asm.add(c)
    with pytest.raises(MalformedFrameError, match="truncated: 399 of 400 bytes"):
        asm.add(mutate(chunks[-1], data=chunks[-1].data[:-1]))


def test_parse_frame_never_raises():
    inbound = parse_frame(b"\xff\xff\xff\xff")
    assert inbound.frame is None and "undecodable" in inbound.error
    assert parse_frame(b"").frame is not None  # empty message: caught by kind checks


def test_hello_checks():
    good = parse_frame(hello_frame("A", '{"cfg": "abc"}')).frame
    assert check_hello(good).session == '{"cfg": "abc"}'
    wrong_version = pb.Frame(hello=pb.Hello(role="A", protocol_version=99))
    with pytest.raises(HandshakeError, match="peer speaks v99"):
        check_hello(wrong_version)
    with pytest.raises(MalformedFrameError, match="expected HELLO.*SCALAR"):
        check_hello(pb.Frame(scalar=pb.Scalar(tag="x")))
    with pytest.raises(ValueError):
        hello_frame("A", "x" * 40_000)


@pytest.mark.parametrize(
    "port,secret",
    [(70_000, b"s" * 32), (5000, b"s" * 5), (5000, b""), (0, b"s" * 32)],
    ids=["port-out-of-range", "short-secret", "port-without-secret", "no-port"],
)
def test_hello_with_a_bad_data_plane_offer_is_refused(port, secret):
    """A server's HELLO that offers a data plane names a real port and a
    32-byte secret, or neither; anything else is one line, not a dial."""
    hello = pb.Hello(role="B", protocol_version=1, data_port=port, data_secret=secret)
    with pytest.raises(MalformedFrameError, match="offers a data plane") as info:
        check_hello(pb.Frame(hello=hello))
    assert "\n" not in str(info.value)
    offer = parse_frame(hello_frame("B", "", 5000, b"s" * 32)).frame
    assert check_hello(offer).role == "B"


def test_fast_tensor_parse_agrees_with_protobuf():
    """parse_frame's TENSOR fast path must never accept a frame differently
    from protobuf: on random corruptions it either errors or agrees exactly."""
    rng = random.Random(0)
    x = torch.randn(3, 50)
    valid = [
        f
        for codec in ("none", "int8")
        for f in tensor_frames(KEY, encode(x, codec), 256)
    ]
    accepted = 0
    for i in range(3000):
        raw = bytearray(rng.choice(valid))
        if i % 3 == 0:
            del raw[rng.randrange(len(raw)) :]
        for _ in range(rng.randint(0 if i % 3 == 0 else 1, 3)):
            if raw:
                raw[rng.randrange(min(len(raw), 40))] = rng.randrange(256)
        raw = bytes(raw)
        fast = parse_frame(raw)
        if fast.frame is None:
            continue
        reference = pb.Frame.FromString(raw)  # must not raise if we accepted
        if fast.data is None:  # first byte corrupted: the plain protobuf path
            assert fast.frame == reference
            continue
        assert reference.WhichOneof("kind") == "tensor"
        merged = pb.TensorChunk()
        merged.CopyFrom(fast.frame.tensor)
        merged.data = bytes(fast.data)
        assert merged == reference.tensor
        accepted += 1
    assert accepted > 300  # the valid and benignly corrupted frames


def test_fast_tensor_parse_rejects_what_protobuf_would_merge():
    raw = next(tensor_frames(KEY, encode(torch.randn(4)), 1024))
    twice = raw + raw  # protobuf merges two Frame.tensor fields; we refuse
    assert pb.Frame.FromString(twice).WhichOneof("kind") == "tensor"
    assert parse_frame(twice).frame is None
    body = raw[2:]  # the chunk's fields; add a second data field
    dup = b"\x12" + bytes([len(body) + 3]) + body + b"\x7a\x01\x00"
    assert pb.Frame.FromString(dup).WhichOneof("kind") == "tensor"
    assert parse_frame(dup).frame is None


def test_fast_parse_feeds_the_assembler():
    x = torch.randn(7, 300)
    asm, _ = assembler()
    for raw in tensor_frames(KEY, encode(x, "int8"), 500):
        inbound = parse_frame(raw)
        assert inbound.frame.tensor.data == b"" and inbound.data is not None
        done = asm.add(inbound.frame.tensor, inbound.data)
    assert torch.allclose(done[1], x, atol=0.05)
