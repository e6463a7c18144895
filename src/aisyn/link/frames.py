"""Frame layer: serialise tensors into chunked frames and validate what arrives.

Pure functions, no threads, no I/O, so every rule here is unit-testable
without a transport; the state machine that puts a received tensor together
from its chunks is :class:`~aisyn.link.assembly.TensorAssembler`.

Outbound tensor frames are produced by hand rather than by filling
``TensorChunk.data`` and calling ``SerializeToString``: the protobuf route would
copy each 4 MiB slice three times (into a bytes object, into the message, into
the serialised string). Here the header is serialised by protobuf and the data
field -- the last one in the message -- is appended with a single join straight
from the tensor's memory. The result is ordinary protobuf wire format
(tests check that ``Frame.FromString`` parses it to the expected message).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch
from google.protobuf.message import DecodeError

from .base import MAX_CHUNK_BYTES, PeerHello
from .codec import Encoded, dtype_name
from .errors import (
    HandshakeError,
    MalformedFrameError,
)
from .proto import tensor_link_pb2 as pb

PROTOCOL_VERSION = 1
#: gRPC message limit: one chunk plus room for its header.
MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + 64 * 1024
MAX_DIMS = 8
MAX_ROLE_CHARS = 64
MAX_SESSION_BYTES = 32 * 1024
#: the one-time secret of a data-plane offer (data_plane.py)
DATA_SECRET_BYTES = 32
_TAG_RE = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")
_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1

TENSOR = "tensor"
SCALAR = "scalar"


class FrameKey(NamedTuple):
    """Address of one tensor or scalar on the link."""

    kind: str  # TENSOR or SCALAR
    tag: str
    step: int
    micro: int

    def __str__(self) -> str:
        if self.kind == SCALAR:
            return f"scalar {self.tag!r} step {self.step}"
        return f"tensor {self.tag!r} step {self.step} micro {self.micro}"


def key_problem(tag: str, step: int, micro: int) -> str | None:
    """Why (tag, step, micro) is not a valid key, or None."""
    if not isinstance(tag, str) or not _TAG_RE.fullmatch(tag):
        return f"tag {tag!r} must be 1-128 characters of [A-Za-z0-9_.:/-]"
    if not isinstance(step, int) or not 0 <= step <= _INT64_MAX:
        return f"step {step!r} must be an int in [0, 2**63)"
    if not isinstance(micro, int) or not 0 <= micro <= _INT32_MAX:
        return f"micro {micro!r} must be an int in [0, 2**31)"
    return None


# --------------------------------------------------------------------- outbound


def hello_frame(
    role: str, session: str, data_port: int = 0, data_secret: bytes = b""
) -> bytes:
    """A HELLO; a server's may offer its data plane (``data_plane.py``)."""
    if len(role) > MAX_ROLE_CHARS:
        raise ValueError(f"role must be at most {MAX_ROLE_CHARS} characters")
    if len(session.encode()) > MAX_SESSION_BYTES:
        raise ValueError(f"session string must be at most {MAX_SESSION_BYTES} bytes")
    hello = pb.Hello(
        role=role,
        protocol_version=PROTOCOL_VERSION,
        session=session,
        data_port=data_port,
        data_secret=data_secret,
    )
    return pb.Frame(hello=hello).SerializeToString()


def scalar_frame(key: FrameKey, value: float) -> bytes:
    scalar = pb.Scalar(tag=key.tag, step=key.step, value=value)
    return pb.Frame(scalar=scalar).SerializeToString()


def error_frame(message: str) -> bytes:
    return pb.Frame(error=pb.Error(message=message[:4096])).SerializeToString()


BYE_FRAME: bytes = pb.Frame(bye=pb.Bye()).SerializeToString()

_FRAME_TENSOR_TAG = b"\x12"  # field 2 (Frame.tensor), wire type 2 (length-delimited)
_CHUNK_DATA_TAG = b"\x7a"  # field 15 (TensorChunk.data), wire type 2


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _chunk_headers(
    key: FrameKey,
    codec: str,
    dtype: torch.dtype,
    shape: Sequence[int],
    side_bytes: int,
    total: int,
    chunk_bytes: int,
) -> Iterator[tuple[bytes, int, int]]:
    """Yield (serialised TensorChunk without data, start, end) per chunk."""
    num = max(1, -(-total // chunk_bytes))
    header = pb.TensorChunk(
        tag=key.tag,
        step=key.step,
        micro=key.micro,
        dtype=dtype_name(dtype),
        shape=shape,
        codec=codec,
        num_chunks=num,
        total_bytes=total,
        side_bytes=side_bytes,
    )
    for index in range(num):
        header.chunk_index = index
        start = index * chunk_bytes
        yield header.SerializeToString(), start, min(total, start + chunk_bytes)


def _chunk_prefixes(
    headers: Iterator[tuple[bytes, int, int]],
) -> Iterator[tuple[bytes, int, int]]:
    """(frame bytes up to the data, start, end) for each of ``_chunk_headers``."""
    for body, start, end in headers:
        data_len = _varint(end - start)
        inner = len(body) + len(_CHUNK_DATA_TAG) + len(data_len) + end - start
        prefix = b"".join(
            (_FRAME_TENSOR_TAG, _varint(inner), body, _CHUNK_DATA_TAG, data_len)
        )
        yield prefix, start, end


def _slices(buffers: list[memoryview], start: int, end: int) -> list[memoryview]:
    """Views of bytes [start, end) of the stream the buffers make end to end."""
    parts, offset = [], 0
    for buf in buffers:
        lo, hi = max(start, offset), min(end, offset + len(buf))
        if lo < hi:
            parts.append(buf[lo - offset : hi - offset])
        offset += len(buf)
    return parts


def _enc_headers(
    key: FrameKey, enc: Encoded, chunk_bytes: int
) -> Iterator[tuple[bytes, int, int]]:
    return _chunk_headers(
        key, enc.codec, enc.dtype, enc.shape, enc.side.numel(), enc.nbytes, chunk_bytes
    )


def _stream(enc: Encoded) -> list[memoryview]:
    parts = (enc.side, enc.payload)
    return [memoryview(t.numpy()).cast("B") for t in parts if t.numel()]


def tensor_frames(
    key: FrameKey,
    enc: Encoded,
    chunk_bytes: int,
    data: ChunkData | None = None,
) -> Iterator[bytes]:
    """Serialised frames carrying ``enc``; each copies its slice exactly once.
    ``data`` gives each chunk's bytes where ``enc``'s buffers are not in
    host memory (a GPU tensor's, staged by ``link/staging.py``)."""
    prefixes = list(_chunk_prefixes(_enc_headers(key, enc, chunk_bytes)))
    parts = _chunk_data(enc, [(s, e) for _, s, e in prefixes], data)
    for (prefix, _, _), views in zip(prefixes, parts, strict=True):
        yield b"".join([prefix, *views])


class Wire(NamedTuple):
    """One frame as the data plane writes it: a serialised Frame (for a
    tensor chunk, without its data) and the data, as views or bytes."""

    header: bytes
    data: Sequence[memoryview | bytes] = ()


def tensor_chunks(
    key: FrameKey,
    enc: Encoded,
    chunk_bytes: int,
    data: ChunkData | None = None,
) -> Iterator[Wire]:
    """The data plane's form of ``tensor_frames``: per chunk, the header and
    views of the data (no copy)."""
    headers = list(_enc_headers(key, enc, chunk_bytes))
    parts = _chunk_data(enc, [(s, e) for _, s, e in headers], data)
    for (body, _, _), views in zip(headers, parts, strict=True):
        header = b"".join((_FRAME_TENSOR_TAG, _varint(len(body)), body))
        yield Wire(header, views)


#: given the (start, end) byte ranges of a tensor's chunks in the stream of its
#: side data then payload, the views of each chunk's bytes in host memory, in
#: order, one chunk at a time
ChunkData = Callable[[list[tuple[int, int]]], Iterator[Sequence[memoryview | bytes]]]


def _chunk_data(
    enc: Encoded, ranges: list[tuple[int, int]], data: ChunkData | None
) -> Iterator[Sequence[memoryview | bytes]]:
    if data is not None:
        return data(ranges)
    buffers = _stream(enc)
    return (_slices(buffers, start, end) for start, end in ranges)


def tensor_wire_size(key: FrameKey, tensor: torch.Tensor, chunk_bytes: int) -> int:
    """Bytes ``tensor_frames`` would produce for an uncompressed tensor."""
    total = tensor.numel() * tensor.dtype.itemsize
    prefixes = _chunk_prefixes(
        _chunk_headers(key, "none", tensor.dtype, tensor.shape, 0, total, chunk_bytes)
    )
    return sum(len(prefix) + end - start for prefix, start, end in prefixes)


# ---------------------------------------------------------------------- inbound


class Deferred(NamedTuple):
    """A frame's data still on the wire (the data plane): ``read_into`` fills
    a destination of exactly ``nbytes`` bytes, so ``TensorAssembler.add`` can
    receive it straight into the tensor once the header has passed its checks."""

    nbytes: int
    read_into: Callable[[memoryview], None]

    def __len__(self) -> int:
        return self.nbytes


class Inbound(NamedTuple):
    """One received message: the parsed frame, or why it could not be parsed."""

    frame: pb.Frame | None
    nbytes: int
    error: str | None = None
    #: A TENSOR frame's data as a view of the received message (gRPC) or still
    #: to be read (the data plane); the chunk's own ``data`` field is then empty.
    data: memoryview | Deferred | None = None


def parse_frame(raw: bytes) -> Inbound:
    """Deserialiser for the transport. Never raises: an exception inside a gRPC
    deserialiser would surface as an opaque INTERNAL error instead of ours."""
    if raw[:1] == _FRAME_TENSOR_TAG:
        return _parse_tensor_frame(raw)
    frame = pb.Frame()
    try:
        frame.ParseFromString(raw)
    except DecodeError as exc:
        return Inbound(None, len(raw), f"undecodable frame of {len(raw)} bytes: {exc}")
    return Inbound(frame, len(raw))


def _read_varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while pos < len(raw) and shift < 64:
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise ValueError("truncated or overlong varint")


def _parse_tensor_frame(raw: bytes) -> Inbound:
    """Fast path for TENSOR frames, the bulk of the traffic.

    Protobuf would copy each 4 MiB data field twice (into the message, then
    into a new bytes object on access). Instead this walks the field tags of
    the TensorChunk, hands every field except ``data`` to protobuf -- which
    still parses and validates them -- and returns ``data`` as a view of the
    received message. It accepts strictly less than protobuf does: the chunk
    must be the only field of the Frame and ``data`` must occur once.
    """
    n = len(raw)
    try:
        length, pos = _read_varint(raw, 1)
        if pos + length != n:
            raise ValueError("the chunk must span the whole frame")
        header = bytearray()
        data: memoryview | None = None
        while pos < n:
            field_start = pos
            key, pos = _read_varint(raw, pos)
            wire = key & 7
            if wire == 0:
                pos = _read_varint(raw, pos)[1]
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            elif wire == 2:
                size, pos = _read_varint(raw, pos)
                if key >> 3 == 15:
                    if data is not None or pos + size > n:
                        raise ValueError("repeated or truncated data field")
                    data = memoryview(raw)[pos : pos + size]
                    pos += size
                    continue
                pos += size
            else:
                raise ValueError(f"unexpected wire type {wire}")
            if pos > n:
                raise ValueError("truncated field")
            header += raw[field_start:pos]
        chunk = pb.TensorChunk.FromString(bytes(header))
    except (ValueError, DecodeError) as exc:
        return Inbound(None, n, f"undecodable TENSOR frame of {n} bytes: {exc}")
    frame = pb.Frame()
    frame.tensor.CopyFrom(chunk)  # header only: a few dozen bytes
    return Inbound(frame, n, data=data if data is not None else memoryview(b""))


def frame_kind(frame: pb.Frame) -> str:
    return frame.WhichOneof("kind") or "empty"


def check_hello(frame: pb.Frame) -> PeerHello:
    """Validate the first frame of a session."""
    if frame_kind(frame) != "hello":
        raise MalformedFrameError(
            f"expected HELLO as the first frame, got {frame_kind(frame).upper()}"
        )
    hello = frame.hello
    if hello.protocol_version != PROTOCOL_VERSION:
        raise HandshakeError(
            f"protocol version mismatch: peer speaks v{hello.protocol_version}, "
            f"this side speaks v{PROTOCOL_VERSION}"
        )
    if len(hello.role) > MAX_ROLE_CHARS or len(hello.session) > MAX_SESSION_BYTES:
        raise MalformedFrameError("HELLO role or session string too long")
    if hello.data_port > 65535 or (
        bool(hello.data_port) != bool(hello.data_secret)
        or len(hello.data_secret) not in (0, DATA_SECRET_BYTES)
    ):
        raise MalformedFrameError(
            f"HELLO offers a data plane on port {hello.data_port} with a "
            f"{len(hello.data_secret)}-byte secret (want 1-65535, "
            f"{DATA_SECRET_BYTES} bytes)"
        )
    return PeerHello(hello.role, hello.protocol_version, hello.session)


def check_scalar(scalar: pb.Scalar) -> FrameKey:
    problem = key_problem(scalar.tag, scalar.step, 0)
    if problem:
        raise MalformedFrameError(f"bad SCALAR frame: {problem}")
    return FrameKey(SCALAR, scalar.tag, scalar.step, 0)
