"""One credential holder cannot lock the other data parties out of the
compute party (issue 17, item 11): it says hello and stays silent, and
reconnects each time it is dropped; the hello timeout drops it in seconds
rather than after the idle timeout, and the fair queue lets the waiting party
in next, told meanwhile that it is queued."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from conftest import CUT, ServerThread, server_settings
from test_server_hardening import fresh_hello

from aisyn.link import LinkOptions, PeerLostError, connect
from aisyn.link.certs import TlsConfig, make_dev_certs
from aisyn.model.segments import parse_partition
from aisyn.split import protocol as proto
from aisyn.split.backbone.compute_party import ComputeParty
from aisyn.split.centre.server import SplitServer
from aisyn.split.session import open_grpc
from aisyn.split.transport import LinkSettings

HELLO_S = 1.0
IDLE_S = 60.0  # long: only the hello timeout may end the squatter's sessions
FAST = LinkOptions(keepalive_s=0.5, keepalive_timeout_s=1.0, drop_unread=False)


@pytest.mark.heavy
def test_a_silent_reconnecting_party_does_not_lock_out_another(
    tmp_path, split_config, token_file, caplog
):
    caplog.set_level(logging.INFO, logger="aisyn.link")
    certs = make_dev_certs(tmp_path / "certs", more_clients=["honest"])
    listen = server_settings(certs, token_file)
    party = ComputeParty(split_config, parse_partition(CUT, split_config), None)
    options = LinkOptions(
        keepalive_s=0.5, keepalive_timeout_s=1.0, recv_timeout_s=IDLE_S
    )
    server = SplitServer(party, listen, options, hello_timeout_s=HELLO_S)
    hello = proto.encode_json(fresh_hello(split_config))
    stop = threading.Event()
    squats: list[float] = []

    def squat() -> None:
        """Hello, silence, dropped; again at once (bounded)."""
        mine = TlsConfig.from_files(certs.client_cert, certs.client_key, certs.ca_cert)
        while not stop.is_set() and len(squats) < 20:
            try:
                link = connect(
                    server.address,
                    token=listen.token(),
                    tls=mine,
                    session=hello,
                    options=FAST,
                    timeout=2,
                )
            except PeerLostError:
                continue  # queued behind the honest party: try again
            t0 = time.monotonic()
            with pytest.raises(PeerLostError):
                link.recv("out", step=0, timeout=30)  # dropped by B
            squats.append(time.monotonic() - t0)
            link.close()

    with ServerThread(server):
        squatter = threading.Thread(target=squat, daemon=True)
        squatter.start()
        deadline = time.monotonic() + 10
        while not squats and time.monotonic() < deadline:
            time.sleep(0.05)
        assert squats, "the squatter never held the slot"
        cert, key = certs.other_client("honest")
        honest = LinkSettings(
            server.address,
            tls_cert=str(cert),
            tls_key=str(key),
            tls_ca=str(certs.ca_cert),
            token_file=str(token_file),
        )
        t0 = time.monotonic()
        # A connect timeout far below the idle timeout (the default is 150 s).
        with open_grpc(
            honest,
            fresh_hello(split_config, "honest"),
            codec="none",
            connect_timeout_s=10,
        ) as opened:
            waited = time.monotonic() - t0
            assert opened.reply["start_step"] == 0
        stop.set()
        squatter.join(30)
    assert waited < 3 * HELLO_S + 2, waited
    # Each squat ended at the hello timeout (the first also waited for B to
    # build its half), not at the idle timeout.
    assert all(s < IDLE_S / 6 for s in squats) and min(squats) < HELLO_S + 1, squats
    assert "queued at position 1" in caplog.text
