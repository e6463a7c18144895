"""Ending a session on purpose: ``abort(reason)`` reaches the peer with the
reason, in memory and over gRPC, and close() right after a rejected frame
neither crashes nor buries the reason it was rejected for."""

from __future__ import annotations

import re
import threading
from dataclasses import replace

import pytest
import torch
from linkutil import FAST, TOKEN, open_pair

from aisyn.link import (
    FrameError,
    FrameMismatchError,
    FrameTooLargeError,
    GrpcLinkServer,
    LinkTimeoutError,
    PeerAbortedError,
    PeerLostError,
    SessionAbortedError,
    connect,
    memory_pair,
)

REASON = "control: unknown op 9"


def test_abort_reaches_the_in_memory_peer_with_its_reason():
    a, b = memory_pair()
    b.abort(f"{REASON}\n(second line)")
    with pytest.raises(PeerAbortedError, match=re.escape(f"{REASON} (second line)")):
        a.recv("out", step=0, timeout=5)
    with pytest.raises(SessionAbortedError, match=re.escape(REASON)):
        b.recv("ctl", step=0, timeout=5)
    a.close()
    b.close()


def test_abort_by_the_server_reaches_the_client_with_its_reason(server):
    a, b = open_pair(server)
    a.send("ctl", torch.zeros(7, dtype=torch.int64), step=0)
    b.recv("ctl", step=0, timeout=5)
    b.abort(REASON)
    b.close()  # at once, as a server does: the reason must still get out
    with pytest.raises(PeerAbortedError, match=f"aborted the session: {REASON}$"):
        a.recv("out", step=0, timeout=5)
    a.close()


def test_abort_by_the_client_reaches_the_server_with_its_reason(server):
    a, b = open_pair(server)
    a.abort("the data party refused the reply: no start_step")
    a.close()
    with pytest.raises(FrameError, match="refused the reply: no start_step"):
        b.recv("ctl", step=0, timeout=5)
    b.close()


def test_abort_after_a_failure_changes_nothing():
    a, b = memory_pair()
    a.send("ctl", torch.zeros(3), step=0)
    with pytest.raises(FrameMismatchError):
        b.recv("ctl", step=0, shape=(7,), timeout=5)
    b.abort("too late")  # the link has already failed: the first reason stays
    with pytest.raises(FrameMismatchError, match="expected"):
        b.recv("ctl", step=0, timeout=5)
    with pytest.raises(FrameError, match="rejected the session: .*expected"):
        a.recv("out", step=0, timeout=5)
    a.close()
    b.close()


def test_close_right_after_a_rejected_frame_keeps_the_reason():
    """The client's receive thread rejects a frame and starts telling the
    server why while the application, woken by the error, closes the link
    at once; the close must wait for that, not crash or cancel over it."""
    small = replace(FAST, max_tensor_bytes=1024)
    with GrpcLinkServer("127.0.0.1:0", token=TOKEN, insecure=True, options=FAST) as srv:
        for _ in range(12):
            a, b = open_pair(srv, options=small)
            b.send("out", torch.zeros(4096), step=0)  # 16 KiB: over A's limit
            with pytest.raises(FrameTooLargeError, match="tensor limit"):
                a.recv("out", step=0, timeout=5)
            a.close()  # raised "cannot join thread before it is started"
            with pytest.raises(FrameError, match="1024-byte tensor limit"):
                b.recv("ctl", step=0, timeout=5)
            b.close()


def test_a_client_told_busy_is_not_aborted(server):
    a, b = open_pair(server)
    with pytest.raises(PeerLostError, match="busy") as info:
        connect(server.address, token=TOKEN, insecure=True, options=FAST, timeout=0.3)
    assert not isinstance(info.value, PeerAbortedError)
    a.close()
    b.close()


def test_a_tensor_the_codec_cannot_carry_ends_the_session_with_the_reason(server):
    a, b = open_pair(server)
    a.send("act", torch.full((4,), 1e6), step=0, codec="fp16")  # fp16 tops at 65504
    with pytest.raises(SessionAbortedError, match="cannot send tensor 'act'"):
        a.flush(5)
    with pytest.raises(FrameError, match="cannot send tensor 'act' step 0"):
        b.recv("act", step=0, timeout=5)
    a.close()
    b.close()


def test_a_session_aborted_right_after_its_hello_is_opened_once():
    """A server that aborts at once (a compute party's bug on the first
    round) answered: connect() returns the link, whose first recv() gives the
    reason, and never dials again. It used to treat the abort, when it won the
    race against its own HELLO, as "not up yet" and open session after session."""
    accepted, done = [], threading.Event()
    with GrpcLinkServer("127.0.0.1:0", token=TOKEN, insecure=True, options=FAST) as srv:

        def serve() -> None:
            while not done.is_set():
                try:
                    b = srv.accept(timeout=0.1)
                except LinkTimeoutError:
                    continue
                accepted.append(b)
                b.abort(REASON)
                b.close()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        for _ in range(20):
            a = connect(
                srv.address, token=TOKEN, insecure=True, options=FAST, timeout=5
            )
            with pytest.raises(PeerAbortedError, match=re.escape(REASON)):
                a.recv("out", step=0, timeout=5)
            a.close()
        done.set()
        thread.join(10)
    assert len(accepted) == 20
