"""The gRPC control port under a flood of idle connections.

gRPC handshakes on its own event loop and holds any number of connections
that never speak; what denies the port is the process's descriptor limit.
With the common soft limit of 1 024, 1 100 idle connections left gRPC's
listener logging "File descriptor limit reached" and every honest client
refused for as long as they stayed (gRPC drops them after 120 s). A link
server makes room for them (the soft limit raised towards the hard one).
"""

from __future__ import annotations

import resource
import socket
import subprocess
import sys
import textwrap

import pytest
from linkutil import TOKEN

from aisyn.link import DevCerts, LinkOptions, connect, make_dev_certs

IDLE = 1100
SOFT_LIMIT = 1024

_SERVER = textwrap.dedent(
    """
    import sys
    from aisyn.link import DevCerts, GrpcLinkServer
    pki = DevCerts.at(sys.argv[1])
    with GrpcLinkServer("127.0.0.1:0", token=sys.argv[2], tls=pki.server_tls()) as srv:
        print(srv.port, flush=True)
        link = srv.accept(timeout=60)
        print("accepted", flush=True)
        link.close()
    """
)


def _low_soft_limit() -> None:  # in the child, before it starts
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT_LIMIT, hard))


@pytest.mark.heavy
def test_control_port_takes_a_client_past_a_thousand_idle_connections(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * IDLE + 512
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"the open-file hard limit ({hard}) cannot hold {need}")
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    pki: DevCerts = make_dev_certs(tmp_path)
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER, str(tmp_path), TOKEN],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=_low_soft_limit,
    )
    held: list[socket.socket] = []
    try:
        port = int(server.stdout.readline())
        for i in range(IDLE):
            s = socket.socket()
            s.bind((f"127.0.0.{2 + i % 16}", 0))
            s.connect(("127.0.0.1", port))
            held.append(s)
        link = connect(
            f"127.0.0.1:{port}",
            token=TOKEN,
            tls=pki.client_tls(),
            options=LinkOptions(close_timeout_s=2.0),
            timeout=8,
        )
        assert server.stdout.readline().strip() == "accepted"
        link.close()
    finally:
        for s in held:
            s.close()
        server.kill()
        server.wait(10)
