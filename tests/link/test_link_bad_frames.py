"""Bad frames injected with a raw stub: each ends only its own session, with a
clear reason on both sides, and the server goes on serving the next session."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace

import grpc
import pytest
import torch
from linkutil import FAST, TOKEN, open_pair

from aisyn.link import (
    FrameError,
    FrameMismatchError,
    FrameOrderError,
    FrameTooLargeError,
    GrpcLinkServer,
    Link,
    LinkTimeoutError,
    MalformedFrameError,
    PeerLostError,
)
from aisyn.link.codec import encode
from aisyn.link.frames import TENSOR, FrameKey, tensor_frames
from aisyn.link.proto import tensor_link_pb2 as pb

METHOD = "/aisyn.link.v1.TensorLink/Exchange"
HELLO = pb.Frame(hello=pb.Hello(role="A", protocol_version=1)).SerializeToString()


def frame(**kind) -> bytes:
    return pb.Frame(**kind).SerializeToString()


def scalar(tag: str = "s", step: int = 0, value: float = 1.0) -> bytes:
    return frame(scalar=pb.Scalar(tag=tag, step=step, value=value))


def tensor_chunks(x: torch.Tensor, chunk: int = 1000, **overrides) -> list[bytes]:
    out = []
    for raw in tensor_frames(FrameKey(TENSOR, "act", 0, 0), encode(x), chunk):
        f = pb.Frame.FromString(raw)
        for name, value in overrides.items():
            setattr(f.tensor, name, value)
        out.append(f.SerializeToString())
    return out


class RawSession:
    """Sends hand-made frames on one Exchange call and reports how it ended."""

    def __init__(self, address: str, frames: list[bytes], token: str = TOKEN) -> None:
        self._channel = grpc.insecure_channel(
            address, options=[("grpc.max_send_message_length", 64 << 20)]
        )
        self._hold = threading.Event()
        exchange = self._channel.stream_stream(
            METHOD,
            request_serializer=lambda b: b,
            response_deserializer=pb.Frame.FromString,
        )
        metadata = [("authorization", f"Bearer {token}")] if token else []
        self._call = exchange(self._requests(frames), metadata=metadata, timeout=10)

    def _requests(self, frames: list[bytes]) -> Iterator[bytes]:
        yield from frames
        self._hold.wait(10)  # keep our half open: the server must end the call

    def outcome(self) -> tuple[grpc.StatusCode, str]:
        try:
            for _ in self._call:
                pass
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
        finally:
            self._hold.set()
            self._channel.close()
        return grpc.StatusCode.OK, ""


@pytest.fixture(scope="module")
def shared_server() -> Iterator[GrpcLinkServer]:
    """One server for all cases: it must survive every one of them."""
    options = replace(FAST, max_tensor_bytes=1 << 20)
    with GrpcLinkServer(
        "127.0.0.1:0", token=TOKEN, insecure=True, options=options
    ) as srv:
        yield srv


def assert_still_serving(srv: GrpcLinkServer) -> None:
    a, b = open_pair(srv)
    x = torch.randn(16, 16)
    a.send("act", x, step=0)
    assert torch.equal(b.recv("act", step=0, timeout=5), x)
    a.close()
    b.close()


# (frames after the HELLO, expected status, substring of its details)
HANDSHAKE_CASES = {
    "garbage_first": (
        [b"\xff\xff\xff"],
        grpc.StatusCode.INVALID_ARGUMENT,
        "undecodable",
    ),
    "no_hello": ([scalar()], grpc.StatusCode.INVALID_ARGUMENT, "expected HELLO"),
    "wrong_version": (
        [frame(hello=pb.Hello(role="A", protocol_version=7))],
        grpc.StatusCode.FAILED_PRECONDITION,
        "peer speaks v7",
    ),
}


@pytest.mark.parametrize("case", list(HANDSHAKE_CASES))
def test_bad_handshake(shared_server, case):
    frames, code, message = HANDSHAKE_CASES[case]
    got = RawSession(shared_server.address, frames).outcome()
    assert got[0] is code and message in got[1], got
    with pytest.raises(LinkTimeoutError):
        shared_server.accept(timeout=0.05)  # no session was opened
    assert_still_serving(shared_server)


@pytest.mark.parametrize(("token", "message"), [("", "missing"), ("nope", "invalid")])
def test_unauthenticated(shared_server, token, message):
    code, details = RawSession(shared_server.address, [HELLO], token=token).outcome()
    assert code is grpc.StatusCode.UNAUTHENTICATED and message in details
    assert_still_serving(shared_server)


x10 = torch.randn(10, 10)  # 400 bytes
chunks = tensor_chunks(x10, chunk=100)  # 4 chunks

STREAM_CASES: dict[str, tuple[list[bytes], type[Exception], str]] = {
    "garbage": ([b"\x0a\xff\xff"], MalformedFrameError, "undecodable"),
    "empty_frame": ([b""], MalformedFrameError, "unexpected EMPTY frame"),
    "second_hello": ([HELLO], MalformedFrameError, "unexpected HELLO"),
    "truncated": (chunks[:2] + [scalar()], MalformedFrameError, "got 2 of 4 chunks"),
    "chunk_order": (
        [chunks[0], chunks[2]],
        FrameOrderError,
        "chunk 2 of tensor 'act' step 0 micro 0 arrived, expected chunk 1",
    ),
    "first_chunk_missing": ([chunks[1]], FrameOrderError, "without chunk 0"),
    "size_mismatch": (
        tensor_chunks(x10, chunk=1000, total_bytes=404),
        MalformedFrameError,
        "header announces",
    ),
    "unknown_dtype": (
        tensor_chunks(x10, chunk=1000, dtype="float8"),
        MalformedFrameError,
        "unknown dtype 'float8'",
    ),
    "over_tensor_limit": (
        tensor_chunks(torch.zeros(512, 1024), chunk=1 << 20)[:1],
        FrameTooLargeError,
        "1048576-byte tensor limit",
    ),
    "bad_tag": ([scalar(tag="a b\n")], MalformedFrameError, "tag 'a b\\n' must be"),
    "step_backwards": (
        [scalar(step=5), scalar(step=4)],
        FrameOrderError,
        "must not decrease",
    ),
    "duplicate_key": ([scalar(), scalar()], FrameOrderError, "duplicate scalar 's'"),
}


@pytest.mark.parametrize("case", list(STREAM_CASES))
def test_bad_frame_in_session(shared_server, case):
    frames, exc_type, message = STREAM_CASES[case]
    raw = RawSession(shared_server.address, [HELLO, *frames])
    link = shared_server.accept(timeout=5)
    with pytest.raises(exc_type, match=re.escape(message)):
        link.recv("never", step=99, timeout=5)
    code, details = raw.outcome()
    assert code is grpc.StatusCode.INVALID_ARGUMENT and message in details
    link.close()
    assert_still_serving(shared_server)


def test_message_over_grpc_limit(shared_server):
    huge = tensor_chunks(torch.zeros(2 << 20), chunk=8 << 20)  # one 8 MiB message
    raw = RawSession(shared_server.address, [HELLO, *huge])
    link = shared_server.accept(timeout=5)
    code, details = raw.outcome()
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    # gRPC drops the call before the servicer sees the message, so the server
    # side can only report that the session ended.
    with pytest.raises(PeerLostError, match="size limit"):
        link.recv("never", step=99, timeout=5)
    link.close()
    assert_still_serving(shared_server)


RecvCheck = Callable[[Link], object]

MISMATCH_CASES: dict[str, tuple[RecvCheck, str]] = {
    "shape": (
        lambda link: link.recv("act", step=0, shape=(4, 4), timeout=5),
        "expected [4, 4], got float32 [10, 10]",
    ),
    "dtype": (
        lambda link: link.recv("act", step=0, dtype=torch.bfloat16, timeout=5),
        "expected bfloat16, got float32",
    ),
}


@pytest.mark.parametrize("case", list(MISMATCH_CASES))
def test_wrong_shape_or_dtype_for_receiver(shared_server, case):
    check, message = MISMATCH_CASES[case]
    raw = RawSession(shared_server.address, [HELLO, *tensor_chunks(x10)])
    link = shared_server.accept(timeout=5)
    with pytest.raises(FrameMismatchError, match=re.escape(message)):
        check(link)
    code, details = raw.outcome()
    assert code is grpc.StatusCode.INVALID_ARGUMENT and message in details
    link.close()
    assert_still_serving(shared_server)


def test_server_frame_rejected_by_client_reaches_server(shared_server):
    """The reverse direction: the client validates too and tells the server."""
    a, b = open_pair(shared_server)
    b.send("grad", torch.zeros(3, 5), step=0)
    with pytest.raises(FrameMismatchError):
        a.recv("grad", step=0, shape=(3, 4), timeout=5)
    with pytest.raises(
        Exception, match="peer rejected the session.*expected \\[3, 4\\]"
    ):
        b.recv("act", step=0, timeout=5)
    a.close()
    b.close()
    assert_still_serving(shared_server)


@pytest.mark.parametrize("side", ["server", "client"])
def test_reason_reaches_peer_even_if_closed_at_once(shared_server, side):
    """close() right after a failure must not replace the reason by CANCELLED."""
    a, b = open_pair(shared_server)
    sender, receiver = (a, b) if side == "server" else (b, a)
    sender.send("t", torch.zeros(2), step=0)
    with pytest.raises(FrameMismatchError):
        receiver.recv("t", step=0, shape=(3,), timeout=5)
    receiver.close()
    with pytest.raises(FrameError, match=re.escape("expected [3], got float32 [2]")):
        sender.recv("never", step=1, timeout=5)
    sender.close()
    assert_still_serving(shared_server)
