"""Helpers shared by the link tests (imported by the tests and conftest.py)."""

from __future__ import annotations

from aisyn.link import GrpcLink, GrpcLinkServer, LinkOptions, connect

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
