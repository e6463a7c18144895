"""The link's bulk data plane (``link/data_plane.py``): two TLS connections
beside the gRPC control stream carry every frame after the HELLOs.

What must hold: the same exact tensors and scalars as on gRPC alone; only the
client that opened the session may attach (its certificate, its secret); a bad
frame on the data plane ends the session with a one-line reason the other
side is told; a lost or silent data plane never leaves anyone hanging; and the
server is ready for the next session after all of it.
"""

from __future__ import annotations

import socket
import ssl
import struct
import threading

import pytest
import torch
from linkutil import FAST, TOKEN, open_pair

from aisyn.link import (
    FrameError,
    FrameTooLargeError,
    GrpcLinkServer,
    HandshakeError,
    LinkError,
    MalformedFrameError,
    PeerAbortedError,
    PeerLostError,
    TlsConfig,
    connect,
    make_dev_certs,
)
from aisyn.link.assembly import ReceivePool
from aisyn.link.data_plane import MAGIC, SECRET_BYTES, UP, tls_context
from aisyn.link.frames import FrameKey, scalar_frame
from aisyn.link.proto import tensor_link_pb2 as pb

_HEADER = struct.Struct("!II")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Dev certificates with a second client ("mallory") of the same CA."""
    return make_dev_certs(tmp_path_factory.mktemp("pki"), more_clients=["mallory"])


@pytest.fixture
def tls_server(pki):
    with GrpcLinkServer(
        "127.0.0.1:0",
        token=TOKEN,
        tls=pki.server_tls(),
        options=FAST,
        data_listen="127.0.0.1:0",
    ) as srv:
        yield srv


@pytest.fixture
def plain_server():
    with GrpcLinkServer(
        "127.0.0.1:0",
        token=TOKEN,
        insecure=True,
        options=FAST,
        data_listen="127.0.0.1:0",
    ) as srv:
        yield srv


def _pair(srv, pki=None, **kwargs):
    if pki is not None:
        kwargs["tls"] = pki.client_tls()
    return open_pair(srv, **kwargs)


def _next_session_works(srv, pki=None) -> None:
    a, b = _pair(srv, pki)
    a.send_scalar("ok", 1.0, step=0)
    assert b.recv_scalar("ok", step=0, timeout=5) == 1.0
    a.close()
    b.close()


@pytest.mark.parametrize("codec", ["none", "fp16", "int8"])
def test_round_trip_is_exact_on_the_data_plane(tls_server, pki, codec):
    a, b = _pair(tls_server, pki)
    assert a._plane is not None and b._plane is not None
    big = torch.randn(3, 1024, 1100)  # 13 MB: four chunks, the last one short
    small = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    a.send("act", big, step=0, codec=codec)
    a.send("ids", small, step=0)
    a.send_scalar("sq", 2.5, step=0)
    got = b.recv("act", step=0, timeout=10)
    if codec == "none":
        assert torch.equal(got, big)
    else:
        assert got.shape == big.shape and (got - big).abs().max() < 0.05
    assert torch.equal(b.recv("ids", step=0, timeout=5), small)
    assert b.recv_scalar("sq", step=0, timeout=5) == 2.5
    b.send("grad", got * 2, step=0)
    assert torch.equal(a.recv("grad", step=0, timeout=10), got * 2)
    a.close()
    b.close()
    assert a.bytes_sent == b.bytes_received and b.bytes_sent == a.bytes_received


def test_plaintext_data_plane_on_loopback(plain_server):
    a, b = _pair(plain_server)
    assert a._plane is not None
    x = torch.randn(64, 64)
    a.send("act", x, step=3, micro=1)
    assert torch.equal(b.recv("act", step=3, micro=1, timeout=5), x)
    a.close()
    b.close()


def test_received_buffers_are_reused_only_once_released():
    pool = ReceivePool(1 << 30)
    first = pool.take(1 << 20)
    first[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    view = first.view(torch.float32)  # the caller still holds a view
    del first
    second = pool.take(1 << 20)
    assert second.data_ptr() != view.data_ptr()  # in use: a fresh one
    assert (
        view[0].item()
        == torch.tensor([1, 2, 3, 4], dtype=torch.uint8).view(torch.float32).item()
    )
    held = second.numpy()  # a numpy array counts as a user too
    del view, second
    third = pool.take(1 << 20)
    assert third.data_ptr() != held.ctypes.data
    del held, third
    assert pool.take(1 << 20) is not None and pool.pooled_bytes == 2 << 20


def test_received_tensor_is_not_overwritten_while_held(tls_server, pki):
    """The pool must never hand out the buffer of a tensor the caller keeps."""
    a, b = _pair(tls_server, pki)
    kept = []
    for step in range(6):
        a.send("act", torch.full((256, 1024), float(step)), step=step)
        kept.append(b.recv("act", step=step, timeout=5))
    for step, tensor in enumerate(kept):
        assert torch.all(tensor == step)
    a.close()
    b.close()


# --------------------------------------------------------- who may attach


def _raw_dial(port: int, pki, direction: bytes, secret: bytes, client: str = "client"):
    """One data-plane connection as an attacker would open it: TLS with the
    named client certificate, then the preamble."""
    if client == "client":
        cert, key = pki.client_cert, pki.client_key
    else:
        cert, key = pki.other_client(client)
    tls = TlsConfig.from_files(cert, key, pki.ca_cert)
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock = tls_context(tls, server=False).wrap_socket(raw, server_hostname="127.0.0.1")
    sock.sendall(MAGIC + direction + secret)
    return sock


def _refused(sock) -> bool:
    try:
        return sock.recv(1) == b""
    except (ConnectionError, ssl.SSLError):
        return True
    finally:
        sock.close()


def test_wrong_secret_or_certificate_cannot_attach(tls_server, pki, monkeypatch):
    """While a session waits for its data plane, a stranger with a wrong
    secret, and another client of the same CA with the right secret, are
    both turned away; the session's own client then attaches."""
    from aisyn.link import grpc_link

    attempts: dict[str, bool] = {}
    real_open = grpc_link._ClientLink._open_plane

    def open_after_attacks(self, address, tls, timeout):
        port, secret = self._offer
        attempts["wrong secret"] = _refused(_raw_dial(port, pki, UP, bytes(32)))
        attempts["other client"] = _refused(
            _raw_dial(port, pki, UP, secret, client="mallory")
        )
        real_open(self, address, tls, timeout)

    monkeypatch.setattr(grpc_link._ClientLink, "_open_plane", open_after_attacks)
    a, b = _pair(tls_server, pki)
    assert attempts == {"wrong secret": True, "other client": True}
    a.send_scalar("x", 1.0, step=0)
    assert b.recv_scalar("x", step=0, timeout=5) == 1.0
    # Once attached, the secret is spent: nobody can add a connection.
    port, secret = a._offer
    assert _refused(_raw_dial(port, pki, UP, secret))
    a.close()
    b.close()


@pytest.mark.slow  # waits out the server's handshake timeout
def test_client_that_never_dials_frees_the_slot(tls_server, pki, monkeypatch):
    from aisyn.link import grpc_link

    monkeypatch.setattr(grpc_link._ClientLink, "_open_plane", lambda self, *args: None)
    # (FAST's handshake timeout is 5 s: the server gives up on the session.)
    a = connect(tls_server.address, token=TOKEN, tls=pki.client_tls(), options=FAST)
    with pytest.raises(HandshakeError, match="did not open its data-plane"):
        a.recv_scalar("never", step=0, timeout=15)
    a.close()
    monkeypatch.undo()
    _next_session_works(tls_server, pki)


def test_unreachable_data_port_fails_connect_in_one_line(tls_server, pki):
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    with pytest.raises(LinkError, match="data plane") as info:
        connect(
            tls_server.address,
            token=TOKEN,
            tls=pki.client_tls(),
            options=FAST,
            timeout=5,
            data_peer=f"127.0.0.1:{port}",
        )
    assert "\n" not in str(info.value)
    _next_session_works(tls_server, pki)


# ------------------------------------------------------------- bad frames


def _inject(link, header: bytes, data: bytes = b"", lengths=None) -> None:
    """Write raw bytes onto a client's data plane, past its own checks."""
    lengths = lengths or (len(header), len(data))
    link._plane.out._sock.sendall(_HEADER.pack(*lengths) + header + data)


def _tensor_header(**fields) -> bytes:
    chunk = dict(
        tag="act",
        step=0,
        micro=0,
        dtype="float32",
        shape=[4],
        codec="none",
        chunk_index=0,
        num_chunks=1,
        total_bytes=16,
        side_bytes=0,
    )
    chunk.update(fields)
    return pb.Frame(tensor=pb.TensorChunk(**chunk)).SerializeToString()


BAD_FRAMES = {
    "header over the limit": (
        b"",
        b"",
        (1 << 20, 0),
        FrameTooLargeError,
        "header of 1048576 bytes",
    ),
    "chunk over the limit": (
        _tensor_header(),
        b"",
        (len(_tensor_header()), 5 << 20),
        FrameTooLargeError,
        "exceeds the",
    ),
    "undecodable header": (b"\xff\xff\xff", b"", None, MalformedFrameError, "undec"),
    "tensor header with data inside": (
        _tensor_header(data=b"x" * 16),
        b"",
        None,
        MalformedFrameError,
        "must not carry data",
    ),
    "scalar with data": (
        scalar_frame(FrameKey("scalar", "s", 0, 0), 1.0),
        b"12345678",
        None,
        MalformedFrameError,
        "carries no data",
    ),
    "more data than announced": (
        _tensor_header(),
        b"x" * 32,
        None,
        MalformedFrameError,
        "more than the 16 bytes",
    ),
    "shape and bytes disagree": (
        _tensor_header(shape=[1 << 40]),
        b"x" * 16,
        None,
        FrameError,
        "bytes",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FRAMES))
def test_bad_frame_on_the_data_plane_ends_the_session(tls_server, pki, case):
    header, data, lengths, error, text = BAD_FRAMES[case]
    a, b = _pair(tls_server, pki)
    _inject(a, header, data, lengths)
    with pytest.raises(error, match=text) as info:
        b.recv("act", step=0, timeout=10)
    assert "\n" not in str(info.value)
    # The client is told why, on the control stream.
    with pytest.raises(FrameError, match=text):
        a.recv("grad", step=0, timeout=10)
    a.close()
    b.close()
    _next_session_works(tls_server, pki)


@pytest.mark.heavy
def test_frame_on_the_control_stream_is_refused(tls_server, pki):
    """With a data plane, the gRPC stream carries no data: a frame there is a
    second, unordered path and ends the session."""
    a, b = _pair(tls_server, pki)
    a._out.put(scalar_frame(FrameKey("scalar", "s", 0, 0), 1.0))
    with pytest.raises(MalformedFrameError, match="control stream"):
        b.recv_scalar("s", step=0, timeout=10)
    a.close()
    b.close()
    _next_session_works(tls_server, pki)


# ------------------------------------------------------- ends and failures


def test_abort_reason_reaches_the_peer(tls_server, pki):
    a, b = _pair(tls_server, pki)
    a.abort("the data party found a NaN")
    with pytest.raises(FrameError, match="found a NaN"):  # as on gRPC alone
        b.recv("act", step=0, timeout=10)
    a.close()
    b.close()
    a, b = _pair(tls_server, pki)
    b.abort("the compute party is shutting down")
    with pytest.raises(PeerAbortedError, match="shutting down"):
        a.recv("grad", step=0, timeout=10)
    a.close()
    b.close()
    _next_session_works(tls_server, pki)


@pytest.mark.heavy
def test_cut_data_plane_is_a_lost_peer(tls_server, pki):
    a, b = _pair(tls_server, pki)
    a._plane.out._sock.sendall(_HEADER.pack(len(_tensor_header()), 16))
    a._plane.out.shutdown()  # mid-frame, and no word on the control stream
    with pytest.raises(PeerLostError):
        b.recv("act", step=0, timeout=15)
    a.close()
    b.close()
    _next_session_works(tls_server, pki)


def test_close_from_either_side_after_traffic(tls_server, pki):
    for closer in ("client", "server"):
        a, b = _pair(tls_server, pki)
        a.send("act", torch.randn(1024, 1024), step=0)
        b.recv("act", step=0, timeout=10)
        first, second = (a, b) if closer == "client" else (b, a)
        first.close()
        with pytest.raises(LinkError):
            second.recv("more", step=1, timeout=10)
        second.close()
    _next_session_works(tls_server, pki)


def test_concurrent_sends_keep_their_order(tls_server, pki):
    """Inline writes of small frames and the sender thread's big ones share
    one connection: whatever the interleaving, every frame arrives whole."""
    a, b = _pair(tls_server, pki)
    big = torch.randn(2, 1024, 1024)

    def bulk():
        for i in range(4):
            a.send("big", big, step=0, micro=i)

    t = threading.Thread(target=bulk)
    t.start()
    for i in range(200):
        a.send_scalar(f"s{i}", float(i), step=0)
    t.join(10)
    for i in range(4):
        assert torch.equal(b.recv("big", step=0, micro=i, timeout=10), big)
    for i in range(200):
        assert b.recv_scalar(f"s{i}", step=0, timeout=5) == float(i)
    a.close()
    b.close()


def test_recv_timeout_leaves_the_session_usable(tls_server, pki):
    """A receiver that reads the data plane itself and times out between
    frames gives the reading back: the next frame still arrives whole."""
    from aisyn.link import LinkTimeoutError

    a, b = _pair(tls_server, pki)
    with pytest.raises(LinkTimeoutError):
        b.recv("act", step=0, timeout=0.3)
    x = torch.randn(512, 1024)
    a.send("act", x, step=0)
    assert torch.equal(b.recv("act", step=0, timeout=5), x)
    a.close()
    b.close()


@pytest.mark.heavy
def test_peer_stalled_mid_frame_does_not_hold_the_receiver(tls_server, pki):
    """Whichever thread is reading when the peer stops mid-frame, the
    receiver's own timeout holds, and aborting then reaches the peer."""
    import time as _time

    from aisyn.link import LinkTimeoutError

    a, b = _pair(tls_server, pki)
    header = _tensor_header()
    a._plane.out._sock.sendall(_HEADER.pack(len(header), 16) + header + b"x" * 4)
    t0 = _time.monotonic()
    with pytest.raises(LinkTimeoutError):
        b.recv("act", step=0, timeout=1)
    assert _time.monotonic() - t0 < 5
    b.abort("the data party stalled mid-frame")
    with pytest.raises(PeerAbortedError, match="stalled mid-frame|part of a frame"):
        a.recv("grad", step=0, timeout=10)
    a.close()
    b.close()
    _next_session_works(tls_server, pki)


def test_a_flood_of_silent_dials_does_not_lock_the_client_out(tls_server, pki):
    """Connections that never finish their handshake, from one address, take
    at most a few slots: the session's own client still attaches."""
    import time as _time

    # An address other than the client's own 127.0.0.1 (all of 127/8 is
    # loopback on Linux).
    silent = []
    for _ in range(70):  # more than the listener's handshakes in all
        s = socket.socket()
        s.bind(("127.0.0.2", 0))
        s.connect(("127.0.0.1", tls_server.data_port))
        silent.append(s)
    _time.sleep(0.2)
    try:
        _next_session_works(tls_server, pki)
    finally:
        for s in silent:
            s.close()


def _hold_idle(port: int, count: int, sources: list[str]) -> list[socket.socket]:
    """``count`` connections that never send a byte, from ``sources`` in turn."""
    held = []
    for i in range(count):
        s = socket.socket()
        s.bind((sources[i % len(sources)], 0))
        s.connect(("127.0.0.1", port))
        held.append(s)
    return held


def _until(predicate, timeout: float = 10.0) -> bool:
    import time as _time

    deadline = _time.monotonic() + timeout
    while not predicate():
        if _time.monotonic() > deadline:
            return False
        _time.sleep(0.02)
    return True


@pytest.mark.parametrize(
    ("max_pending", "addresses"),
    [(None, 16), (64, 16), (64, 992)],
    ids=["default cap", "cap 64", "cap 64, an address each"],
)
def test_a_thousand_idle_connections_do_not_lock_the_client_out(
    pki, max_pending, addresses
):
    """1 000 connections that never authenticate, held open -- 8 from the
    session's own client address, the rest from other loopback addresses
    (16, or one each) -- while the session's client attaches. Before, 4 from
    one address (or 64 in all) made the listener drop every later dial, the
    client's included. The listener holds at most its cap of them (an idle
    one costs a socket, no TLS state); past the cap the flood's own
    connections make room."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * 1000 + 512  # both ends of every connection live in this process
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"the open-file limit ({hard}) cannot hold {need}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    extra = {} if max_pending is None else {"data_max_pending": max_pending}
    with GrpcLinkServer(
        "127.0.0.1:0",
        token=TOKEN,
        tls=pki.server_tls(),
        options=FAST,
        data_listen="127.0.0.1:0",
        **extra,
    ) as srv:
        listener = srv._plane
        cap = listener.max_pending
        others = [f"127.0.{2 + i // 250}.{1 + i % 250}" for i in range(addresses)]
        held = _hold_idle(srv.data_port, 8, ["127.0.0.1"])
        held += _hold_idle(srv.data_port, 992, others)
        try:
            assert _until(lambda: listener.pending() == min(1000, cap))
            assert not any(p.started for p in list(listener._pending.values()))
            _next_session_works(srv, pki)
            _next_session_works(srv, pki)
            assert listener.peak_pending <= cap
            if max_pending is None:  # room for all: the flood was not dropped
                assert cap >= 1000 and listener.pending() >= 990
        finally:
            for s in held:
                s.close()


def test_a_connection_just_accepted_is_not_the_first_to_go(pki):
    """At the cap, a connection that has sent nothing goes before one
    mid-handshake -- but not one accepted a moment ago, which has had no
    chance to speak (the honest client's ClientHello is read a loop turn
    after its accept). Before, with the flood's connections all one byte
    into a handshake from an address each, the very next dial pushed out the
    newly accepted one: an honest client was locked out by a trickle of dials,
    not by the cap's worth the listener's design assumes."""
    from aisyn.link.data_listener import DataListener

    listener = DataListener(
        "127.0.0.1:0", pki.server_tls(), timeout=30.0, max_pending=4
    )
    held: list[socket.socket] = []

    def dial(source: str, first_byte: bool) -> socket.socket:
        s = socket.socket()
        s.bind((source, 0))
        s.connect(("127.0.0.1", listener.port))
        if first_byte:
            s.sendall(b"\x16")  # the first byte of a TLS record, and no more
        held.append(s)
        return s

    def sources() -> set[str]:
        return {p.addr[0] for p in list(listener._pending.values())}

    try:
        for i in range(4):  # the cap's worth, each one byte into a handshake
            dial(f"127.0.3.{i + 1}", first_byte=True)
        assert _until(
            lambda: (
                listener.pending() == 4
                and all(p.started for p in list(listener._pending.values()))
            )
        )
        dial("127.0.4.1", first_byte=False)  # the newcomer, not yet heard
        assert _until(lambda: "127.0.4.1" in sources())
        dial("127.0.3.9", first_byte=True)  # one more of the flood's
        assert _until(lambda: "127.0.3.9" in sources())
        assert "127.0.4.1" in sources()  # the oldest of the flood's went instead
        assert "127.0.3.1" not in sources()
        assert listener.pending() == 4
    finally:
        listener.stop()
        for s in held:
            s.close()


def test_refused_connections_do_not_fill_the_log(plain_server, caplog):
    """Every connection with a whole but wrong preamble logged a warning of
    its own: a client refused in a loop (any tenant's certificate passes the
    TLS handshake) wrote lines as fast as it dialled. The first few are
    logged; the rest are counted for the listener's periodic report."""
    import logging

    listener = plain_server._plane
    with caplog.at_level(logging.WARNING, logger="aisyn.link.data_listener"):
        for _ in range(20):
            with socket.create_connection(("127.0.0.1", plain_server.data_port)) as s:
                s.sendall(MAGIC + UP + b"\0" * SECRET_BYTES)
                s.settimeout(5)
                assert s.recv(1) == b""  # refused: closed without an answer
    refusals = [r for r in caplog.records if "refused a connection" in r.message]
    assert 1 <= len(refusals) <= 5
    assert listener._refused == 20  # (all of them counted for the report)


@pytest.mark.heavy
def test_a_client_gets_in_under_a_steady_stream_of_new_dials(pki):
    """Dials that never stop, each from a fresh address and one byte into a
    handshake, against a cap of 16. Each newcomer at the cap pushes out one of
    the oldest, and the listener accepted up to 64 per wake-up: more than the
    cap arrived while the client took its few turns of handshake, and the
    client was pushed out (7 sessions in 8 failed). It accepts an eighth of
    the cap per wake-up now, and the client's two dials get in every time."""
    import collections

    with GrpcLinkServer(
        "127.0.0.1:0",
        token=TOKEN,
        tls=pki.server_tls(),
        options=FAST,
        data_listen="127.0.0.1:0",
        data_max_pending=16,
    ) as srv:
        stop = threading.Event()
        dials = [0]

        def flood() -> None:
            held: collections.deque[socket.socket] = collections.deque()
            while not stop.is_set():
                dials[0] += 1
                s = socket.socket()
                try:
                    s.bind((f"127.1.{dials[0] // 250 % 250}.{1 + dials[0] % 250}", 0))
                    s.connect(("127.0.0.1", srv.data_port))
                    s.sendall(b"\x16")
                except OSError:
                    s.close()
                    continue
                held.append(s)
                while len(held) > 32:
                    held.popleft().close()
            for s in held:
                s.close()

        flooder = threading.Thread(target=flood, daemon=True)
        flooder.start()
        try:
            assert _until(lambda: dials[0] > 100)
            for _ in range(4):
                _next_session_works(srv, pki)
        finally:
            stop.set()
            flooder.join(10)
        assert srv._plane.peak_pending <= 16
