"""gRPC link: round trips, chunking, TLS, authentication and peer loss."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
import torch
from linkutil import FAST, TOKEN, open_pair

from aisyn.link import (
    AuthError,
    CertificateError,
    GrpcLinkServer,
    HandshakeError,
    LinkClosedError,
    LinkTimeoutError,
    PeerLostError,
    connect,
    make_dev_certs,
)
from aisyn.link.proto import tensor_link_pb2 as pb
from aisyn.link.proto import tensor_link_pb2_grpc as pb_grpc
from aisyn.net import free_port


def test_round_trip_is_exact_both_ways(server):
    a, b = open_pair(server, session='{"config": "abc123", "resume_step": 0}')
    assert b.peer.role == "A" and b.peer.session.startswith('{"config"')
    assert a.peer.role == "B"
    x = torch.randn(8, 128, 64)
    a.send("act", x, step=0, micro=0)
    y = b.recv("act", step=0, micro=0, shape=x.shape, dtype=torch.float32, timeout=5)
    assert torch.equal(x, y)
    b.send("grad", y * 2, step=0, micro=0)
    b.send_scalar("gnorm2", 12.25, step=0)
    assert torch.equal(a.recv("grad", step=0, timeout=5), x * 2)
    assert a.recv_scalar("gnorm2", step=0, timeout=5) == 12.25
    for dtype in (torch.bfloat16, torch.float16, torch.int64, torch.bool):
        t = (torch.randn(5, 7) * 100).to(dtype)
        a.send(f"t_{str(dtype)[6:]}", t, step=1)
        assert torch.equal(b.recv(f"t_{str(dtype)[6:]}", step=1, timeout=5), t)
    a.flush(timeout=5)
    b.flush(timeout=5)
    a.close()
    b.close()
    assert a.bytes_sent == b.bytes_received > x.numel() * 4
    assert b.bytes_sent == a.bytes_received > x.numel() * 4


@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "int8"])
def test_tensor_over_4mb_is_chunked_and_reassembled(server, codec):
    a, b = open_pair(server)
    x = torch.randn(3, 1024, 1024)  # 12 MiB -> 3 chunks raw
    a.send("act", x, step=0, codec=codec)
    y = b.recv("act", step=0, shape=x.shape, dtype=x.dtype, timeout=10)
    err = float((y - x).norm() / x.norm())
    assert err == 0.0 if codec == "none" else err < 0.01
    wire = {"none": 12, "fp16": 6, "bf16": 6, "int8": 3 * 1.0625}[codec] * 2**20
    assert wire < b.bytes_received < wire * 1.01
    a.close()
    b.close()


def test_micro_batches_in_flight_matched_by_key(server):
    a, b = open_pair(server)
    xs = [torch.full((256, 1024), float(m)) for m in range(6)]
    for m, x in enumerate(xs):
        a.send("act", x, step=2, micro=m)
    for m in (5, 0, 3, 1, 4, 2):
        assert torch.equal(b.recv("act", step=2, micro=m, timeout=5), xs[m])
    a.close()
    b.close()


def test_mutual_tls_round_trip(certs):
    with GrpcLinkServer(
        "127.0.0.1:0", token=TOKEN, tls=certs.server_tls(), options=FAST
    ) as srv:
        a, b = open_pair(srv, tls=certs.client_tls())
        x = torch.randn(1024, 1024)
        a.send("act", x, step=0)
        assert torch.equal(b.recv("act", step=0, timeout=5), x)
        a.close()
        b.close()
        # Also by host name (the certificate carries both SANs).
        a = connect(
            f"localhost:{srv.port}", token=TOKEN, tls=certs.client_tls(), timeout=5
        )
        srv.accept(timeout=5).close()
        a.close()


def test_wrong_token_rejected_and_server_keeps_serving(server):
    t0 = time.monotonic()
    with pytest.raises(AuthError, match="invalid token"):
        connect(server.address, token="wrong", insecure=True, timeout=5)
    assert time.monotonic() - t0 < 2, "auth failures are not retried"
    with pytest.raises(LinkTimeoutError):
        server.accept(timeout=0.1)
    a, b = open_pair(server)
    a.send_scalar("ok", 1.0, step=0)
    assert b.recv_scalar("ok", step=0, timeout=5) == 1.0
    a.close()
    b.close()


def test_tls_client_without_certificate_is_rejected(certs):
    with GrpcLinkServer(
        "127.0.0.1:0", token=TOKEN, tls=certs.server_tls(), options=FAST
    ) as srv:
        creds = grpc.ssl_channel_credentials(
            root_certificates=certs.ca_cert.read_bytes()
        )
        with grpc.secure_channel(srv.address, creds) as channel:
            stub = pb_grpc.TensorLinkStub(channel)
            hello = pb.Frame(hello=pb.Hello(role="A", protocol_version=1))
            call = stub.Exchange(
                iter([hello]),
                metadata=[("authorization", f"Bearer {TOKEN}")],
                timeout=5,
            )
            with pytest.raises(grpc.RpcError) as info:
                list(call)
            assert info.value.code() is grpc.StatusCode.UNAVAILABLE
        with pytest.raises(LinkTimeoutError):
            srv.accept(timeout=0.1)
        a, b = open_pair(srv, tls=certs.client_tls())  # a proper client still works
        a.close()
        b.close()


def test_client_certificate_from_another_ca_is_rejected(certs, tmp_path):
    other = make_dev_certs(tmp_path / "other")
    with GrpcLinkServer(
        "127.0.0.1:0", token=TOKEN, tls=certs.server_tls(), options=FAST
    ) as srv:
        # at once, not after retrying for the whole timeout
        with pytest.raises(CertificateError, match="not signed by our CA"):
            connect(srv.address, token=TOKEN, tls=other.client_tls(), timeout=30)


def test_plaintext_rules():
    with pytest.raises(ValueError, match="non-loopback"):
        connect("10.1.2.3:50051", token=TOKEN, insecure=True)
    with pytest.raises(ValueError, match="non-loopback"):
        GrpcLinkServer("0.0.0.0:0", token=TOKEN, insecure=True)
    with pytest.raises(ValueError, match="TLS material is required"):
        connect("127.0.0.1:1", token=TOKEN)
    with pytest.raises(ValueError, match="token"):
        connect("127.0.0.1:1", token="", insecure=True)
    srv = GrpcLinkServer(
        "0.0.0.0:0", token=TOKEN, insecure=True, allow_insecure_remote=True
    )
    assert srv.port > 0
    srv.stop(0)


def test_session_refused_by_server_hook(server):
    def check(hello):
        if hello.session != "cfg-v2":
            raise HandshakeError(f"config mismatch: {hello.session!r} != 'cfg-v2'")
        return "ok"

    with GrpcLinkServer(
        "127.0.0.1:0", token=TOKEN, insecure=True, session=check, options=FAST
    ) as srv:
        with pytest.raises(HandshakeError, match="config mismatch"):
            connect(
                srv.address, token=TOKEN, insecure=True, session="cfg-v1", timeout=5
            )
        a, b = open_pair(srv, session="cfg-v2")
        assert a.peer.session == "ok"
        a.close()
        b.close()


def test_second_client_waits_for_the_session_slot(server):
    a, b = open_pair(server)
    with pytest.raises(PeerLostError, match="busy"):
        connect(server.address, token=TOKEN, insecure=True, options=FAST, timeout=0.5)
    a.close()
    b.close()
    a, b = open_pair(server)
    a.close()
    b.close()


def test_connect_retries_until_the_server_is_up():
    port = free_port()
    srv = GrpcLinkServer(f"127.0.0.1:{port}", token=TOKEN, insecure=True, options=FAST)
    timer = threading.Timer(0.5, srv.start)
    timer.start()
    try:
        a = connect(f"127.0.0.1:{port}", token=TOKEN, insecure=True, timeout=5)
        b = srv.accept(timeout=5)
        a.close()
        b.close()
    finally:
        timer.join()
        srv.stop(0)


def test_close_from_either_side(server):
    for closer in ("client", "server"):
        a, b = open_pair(server)
        first, second = (a, b) if closer == "client" else (b, a)
        first.send("last", torch.ones(4), step=0)
        first.close()
        assert torch.equal(second.recv("last", step=0, timeout=5), torch.ones(4))
        with pytest.raises(PeerLostError, match="peer closed the link"):
            second.recv("more", step=0, timeout=5)
        second.close()
        with pytest.raises(LinkClosedError):
            second.recv("more", step=0, timeout=1)


def test_client_channel_dropped_is_detected_by_server(server):
    a, b = open_pair(server)
    a._channel.close()  # no goodbye: as if the process died
    t0 = time.monotonic()
    with pytest.raises(PeerLostError):
        b.recv("act", step=0, timeout=10)
    assert time.monotonic() - t0 < 3
    b.close()
    a.close()


def test_server_stop_is_detected_by_client():
    srv = GrpcLinkServer(
        "127.0.0.1:0", token=TOKEN, insecure=True, options=FAST
    ).start()
    a, b = open_pair(srv)
    t0 = time.monotonic()
    threading.Timer(0.2, srv.stop, args=(0,)).start()
    with pytest.raises(PeerLostError, match="lost 127.0.0.1"):
        a.recv("grad", step=0, timeout=10)
    assert time.monotonic() - t0 < 3
    with pytest.raises(LinkClosedError, match="server was stopped"):
        b.recv("act", step=0, timeout=10)
    a.close()
    b.close()


class Blackhole:
    """TCP forwarder that can go silent without closing sockets (a frozen peer
    or a dead network path: only keepalive can detect it)."""

    def __init__(self, target_port: int) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._target = target_port
        self.frozen = threading.Event()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self._target))
            self._socks += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(
                    target=self._pump, args=(src, dst), daemon=True
                ).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                while self.frozen.is_set():
                    time.sleep(0.05)
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self._listener.close()
        for s in self._socks:
            s.close()


@pytest.mark.heavy
def test_silent_peer_is_detected_by_keepalive(server):
    hole = Blackhole(server.port)
    try:
        a = connect(
            f"127.0.0.1:{hole.port}",
            token=TOKEN,
            insecure=True,
            options=FAST,
            timeout=5,
        )
        b = server.accept(timeout=5)
        a.send("act", torch.ones(3), step=0)
        assert torch.equal(b.recv("act", step=0, timeout=5), torch.ones(3))
        hole.frozen.set()
        t0 = time.monotonic()
        with pytest.raises(PeerLostError):
            a.recv("grad", step=0, timeout=15)
        with pytest.raises(PeerLostError):
            b.recv("act", step=1, timeout=15)
        elapsed = time.monotonic() - t0
        # keepalive 0.5 s + ack timeout 1 s, plus scheduling slack
        assert elapsed < 5, f"peer loss took {elapsed:.1f} s to detect"
        a.close()
        b.close()
    finally:
        hole.close()
