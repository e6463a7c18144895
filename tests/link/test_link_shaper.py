"""ShapedProxy adds the configured latency and caps the rate (generous bounds)."""

from __future__ import annotations

import socket
import threading
import time

import torch
from linkutil import FAST, TOKEN

from aisyn.link import ShapedProxy, connect


def serve(handler) -> tuple[socket.socket, int]:
    listener = socket.create_server(("127.0.0.1", 0))

    def loop() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=handler, args=(conn,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    return listener, listener.getsockname()[1]


def echo(conn: socket.socket) -> None:
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)


def ping_ms(port: int, rounds: int = 5) -> float:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            s.sendall(b"x")
            assert s.recv(1) == b"x"
            best = min(best, time.perf_counter() - t0)
    return best * 1000


def test_adds_round_trip_latency():
    listener, port = serve(echo)
    try:
        direct = ping_ms(port)
        with ShapedProxy(0, "127.0.0.1", port, latency_ms_rtt=80) as proxy:
            shaped = ping_ms(proxy.port)
        assert 78 <= shaped <= 80 + 60, (direct, shaped)
    finally:
        listener.close()


def test_caps_bandwidth_in_each_direction():
    done = threading.Event()
    received = []

    def sink(conn: socket.socket) -> None:
        total, first = 0, None
        with conn:
            while data := conn.recv(65536):
                first = first or time.perf_counter()
                total += len(data)
        received.append((total, time.perf_counter() - first))
        done.set()

    listener, port = serve(sink)
    rate = 16e6  # bits/s = 2 MB/s
    payload = b"\0" * 1_000_000
    try:
        with ShapedProxy(0, "127.0.0.1", port, bandwidth_bits_per_s=rate) as proxy:
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as s:
                s.sendall(payload)
            assert done.wait(10)
        total, seconds = received[0]
        expected = len(payload) * 8 / rate  # 0.5 s
        assert total == len(payload)
        assert 0.8 * expected <= seconds <= 2.0 * expected, seconds
    finally:
        listener.close()


def test_half_close_propagates_and_stop_is_clean():
    listener, port = serve(echo)
    try:
        proxy = ShapedProxy(0, "127.0.0.1", port, latency_ms_rtt=10).start()
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as s:
            s.sendall(b"hello")
            s.shutdown(socket.SHUT_WR)
            got = b""
            while data := s.recv(100):
                got += data
        assert got == b"hello"
        proxy.stop()
        proxy.stop()  # idempotent
    finally:
        listener.close()


def test_grpc_link_through_the_proxy(server):
    with ShapedProxy(0, "127.0.0.1", server.port, latency_ms_rtt=40) as proxy:
        a = connect(
            f"127.0.0.1:{proxy.port}",
            token=TOKEN,
            insecure=True,
            options=FAST,
            timeout=5,
        )
        b = server.accept(timeout=5)
        x = torch.randn(256, 1024)
        a.send("act", x, step=0)
        assert torch.equal(b.recv("act", step=0, timeout=5), x)
        t0 = time.perf_counter()
        a.send_scalar("ping", 1.0, step=1)
        b.send_scalar("pong", b.recv_scalar("ping", step=1, timeout=5), step=1)
        assert a.recv_scalar("pong", step=1, timeout=5) == 1.0
        assert time.perf_counter() - t0 >= 0.039
        a.close()
        b.close()
