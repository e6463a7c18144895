"""The link server's one session slot: always released after a failed
handshake, whatever failed, and held until the application has closed the
session's link, so that sessions cannot pile up behind it."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from linkutil import FAST, TOKEN, open_pair

from aisyn.link import (
    Accept,
    GrpcLinkServer,
    HandshakeError,
    LinkTimeoutError,
    PeerHello,
    PeerLostError,
    connect,
)

DEEP_JSON = "[" * 16000 + "]" * 16000  # fits the 32 KiB session string


def dial(srv: GrpcLinkServer, session: str = "", timeout: float = 5):
    return connect(
        srv.address,
        token=TOKEN,
        insecure=True,
        session=session,
        options=FAST,
        timeout=timeout,
    )


def test_a_callback_that_blows_up_refuses_only_that_session(caplog):
    def check(hello: PeerHello) -> str:
        json.loads(hello.session)  # RecursionError on DEEP_JSON
        return "ok"

    with GrpcLinkServer(
        "127.0.0.1:0", token=TOKEN, insecure=True, session=check, options=FAST
    ) as srv:
        for _ in range(2):  # the second would be refused as busy if the slot leaked
            with pytest.raises(HandshakeError, match="could not process the hello"):
                dial(srv, DEEP_JSON)
        assert "RecursionError" in caplog.text  # the details stay in the server's log
        a, b = open_pair(srv, session='{"ok": 1}')
        assert a.peer.session == "ok"
        a.close()
        b.close()


def test_a_session_holds_the_slot_until_its_link_is_closed(server):
    a, b = open_pair(server)
    a._channel.close()  # the client vanishes: its call ends at once
    with pytest.raises(PeerLostError):
        b.recv("ctl", step=0, timeout=5)
    # The application still has b: no second session may queue up behind it.
    with pytest.raises(PeerLostError, match="busy"):
        dial(server, timeout=0.5)
    a.close()
    b.close()
    a, b = open_pair(server)
    a.send("ctl", torch.ones(2), step=0)
    assert torch.equal(b.recv("ctl", step=0, timeout=5), torch.ones(2))
    a.close()
    b.close()


def test_dropped_sessions_do_not_pile_up(server):
    """Clients that connect and vanish at once, faster than the application
    takes sessions: each waits its turn instead of queueing a session (and its
    threads, buffers and gRPC call) behind the one being served."""
    opened: list[bool] = []

    def hit_and_run() -> None:
        try:
            link = dial(server, timeout=1.0)
        except PeerLostError:  # busy all along: fine
            opened.append(False)
            return
        opened.append(True)
        link._channel.close()
        link.close()

    clients = [threading.Thread(target=hit_and_run) for _ in range(5)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(10)
    assert opened.count(True) == 1, opened  # the rest were told "busy"
    b = server.accept(timeout=1)
    b.close()
    with pytest.raises(LinkTimeoutError, match="no session"):
        server.accept(timeout=0.2)


def test_accept_hands_each_connection_its_own_agreement():
    serial = iter(range(100))

    def agree(hello: PeerHello) -> Accept:
        return Accept(f"reply to {hello.session}", next(serial))

    with GrpcLinkServer(
        "127.0.0.1:0", token=TOKEN, insecure=True, session=agree, options=FAST
    ) as srv:
        for expected in range(3):  # the same hello text every time
            a, b = open_pair(srv, session="same")
            assert a.peer.session == "reply to same"
            assert b.agreed == expected
            a.close()
            b.close()
