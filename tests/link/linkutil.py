"""Helpers shared by the link tests (imported by the tests and conftest.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from aisyn.link import GrpcLink, GrpcLinkServer, Link, LinkOptions, connect, memory_pair

TOKEN = "test-token-0123456789"
#: Short keepalive/handshake/close timeouts so failure tests finish quickly.
FAST = LinkOptions(
    keepalive_s=0.5,
    keepalive_timeout_s=1.0,
    handshake_timeout_s=5.0,
    close_timeout_s=2.0,
)


def open_pair(srv: GrpcLinkServer, **kwargs) -> tuple[GrpcLink, GrpcLink]:
    """(client link, server link) for one fresh session on ``srv``."""
    kwargs.setdefault("token", TOKEN)
    kwargs.setdefault("options", FAST)
    if "tls" not in kwargs:
        kwargs.setdefault("insecure", True)
    client = connect(srv.address, timeout=5, **kwargs)
    return client, srv.accept(timeout=5)


@contextlib.contextmanager
def transport_pair(transport: str) -> Iterator[tuple[Link, Link]]:
    """(sender, receiver) on "memory", "grpc" or "data-plane" (gRPC with its
    bulk data plane); both closed on the way out."""
    if transport == "memory":
        a, b = memory_pair()
        yield a, b
    else:
        extra = {"data_listen": "127.0.0.1:0"} if transport == "data-plane" else {}
        with GrpcLinkServer(
            "127.0.0.1:0", token=TOKEN, insecure=True, options=FAST, **extra
        ) as srv:
            a, b = open_pair(srv)
            assert (a._plane is not None) == (transport == "data-plane")
            yield a, b
    a.close()
    b.close()
