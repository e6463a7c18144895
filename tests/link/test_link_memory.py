"""In-memory pair: exactness, zero copy, key matching and the protocol rules."""

from __future__ import annotations

import time

import pytest
import torch

from aisyn.link import (
    FrameError,
    FrameMismatchError,
    FrameOrderError,
    LinkClosedError,
    LinkOptions,
    LinkTimeoutError,
    PeerLostError,
    memory_pair,
)


@pytest.fixture(params=["none", "int8"])
def pair(request):
    a, b = memory_pair(request.param)
    yield a, b
    a.close()
    b.close()


def test_zero_copy_detached_and_exact():
    a, b = memory_pair()
    w = torch.randn(4, 4, requires_grad=True)
    x = w * 3
    a.send("act", x, step=0)
    y = b.recv("act", step=0, shape=(4, 4), dtype=torch.float32, timeout=2)
    assert torch.equal(y, x.detach())
    assert y.data_ptr() == x.data_ptr(), "codec none hands over the same memory"
    assert not y.requires_grad and y.grad_fn is None, "no autograd graph crosses"
    assert a.bytes_sent == b.bytes_received > x.numel() * 4
    a.close()
    b.close()


def test_codec_path_serialises_and_counts_compressed_bytes():
    a, b = memory_pair("int8")
    x = torch.randn(64, 1024)
    a.send("act", x, step=0)
    y = b.recv("act", step=0, timeout=2)
    assert y.data_ptr() != x.data_ptr()
    assert float((y - x).norm() / x.norm()) < 0.01
    assert b.bytes_received < x.numel() * 4 * 0.3
    a.send("exact", x, step=0, codec="none")  # per-send override
    assert torch.equal(b.recv("exact", step=0, timeout=2), x)
    a.close()
    b.close()


def test_recv_matches_by_key_in_any_order(pair):
    a, b = pair
    xs = [torch.full((3,), float(m)) for m in range(4)]
    for m, x in enumerate(xs):
        a.send("act", x, step=7, micro=m)
    a.send_scalar("gnorm2", 2.5, step=7)
    assert b.recv_scalar("gnorm2", step=7, timeout=2) == 2.5
    for m in (3, 1, 0, 2):
        assert torch.equal(b.recv("act", step=7, micro=m, timeout=2), xs[m])
    # Both directions at once, tags are independent namespaces.
    b.send("grad", xs[1], step=7, micro=1)
    b.send("grad", xs[0], step=7, micro=0)
    assert torch.equal(a.recv("grad", step=7, micro=0, timeout=2), xs[0])
    assert torch.equal(a.recv("grad", step=7, micro=1, timeout=2), xs[1])


def test_sender_side_rules_raise_immediately(pair):
    a, _ = pair
    a.send("act", torch.zeros(1), step=5)
    with pytest.raises(ValueError, match="already sent"):
        a.send("act", torch.zeros(1), step=5)
    with pytest.raises(ValueError, match="must not decrease"):
        a.send("act", torch.zeros(1), step=4, micro=1)
    with pytest.raises(ValueError, match="tag"):
        a.send("no spaces", torch.zeros(1), step=5)
    with pytest.raises(ValueError, match="cannot be sent"):
        a.send("c", torch.zeros(1, dtype=torch.complex64), step=5)
    with pytest.raises(TypeError):
        a.send("act", [1.0, 2.0], step=6)  # type: ignore[arg-type]


def test_recv_timeout_then_still_usable(pair):
    a, b = pair
    t0 = time.monotonic()
    with pytest.raises(
        LinkTimeoutError,
        match="timed out after 0.2 s waiting for tensor 'act' step 0 micro 0",
    ):
        b.recv("act", step=0, timeout=0.2)
    assert 0.15 < time.monotonic() - t0 < 2
    a.send("act", torch.ones(2), step=0)
    assert torch.equal(b.recv("act", step=0, timeout=2), torch.ones(2))


def test_shape_mismatch_ends_session_on_both_sides(pair):
    a, b = pair
    a.send("act", torch.zeros(2, 3), step=0)
    with pytest.raises(
        FrameMismatchError,
        match=r"expected \[4, 4\], got "
        r"float32 \[2, 3\]",
    ):
        b.recv("act", step=0, shape=(4, 4), timeout=2)
    with pytest.raises(FrameError, match="peer rejected the session"):
        a.recv("grad", step=0, timeout=2)
    with pytest.raises(FrameMismatchError):  # sticky
        b.recv("act", step=0, timeout=2)


def test_dtype_mismatch(pair):
    a, b = pair
    a.send("act", torch.zeros(2, dtype=torch.float16), step=0)
    with pytest.raises(FrameMismatchError, match="expected float32, got float16"):
        b.recv("act", step=0, dtype=torch.float32, timeout=2)


def test_frames_of_a_left_step_are_dropped_whenever_they_arrive(pair, caplog):
    a, b = pair
    a.send("extra", torch.zeros(1), step=0)  # never received by b
    a.send("act", torch.zeros(1), step=1)
    b.recv("act", step=1, timeout=2)
    with pytest.raises(ValueError, match="already moved on to step 1"):
        b.recv("extra", step=0, timeout=2)
    a.send("act", torch.ones(1), step=2)
    assert torch.equal(b.recv("act", step=2, timeout=2), torch.ones(1))
    assert "dropping" in caplog.text and "'extra' step 0" in caplog.text
    assert b._pending_bytes == 0, "dropped frames release their memory"


def test_waiting_for_a_step_the_peer_has_left_fails_at_once(pair):
    """Steps never decrease on the wire: once the peer has sent step 1, nothing
    of step 0 can come any more, so a receiver waiting for it is told now."""
    a, b = pair
    a.send("out", torch.zeros(1), step=1)  # a peer answering under the wrong step
    t0 = time.monotonic()
    with pytest.raises(
        FrameOrderError,
        match="tensor 'out' step 0 micro 0 never came: the peer went on to step 1",
    ):
        b.recv("out", step=0, timeout=30)
    assert time.monotonic() - t0 < 5, "failed at once, not at the timeout"
    with pytest.raises(FrameError, match="never came"):  # the peer learns why
        a.recv("gout", step=1, timeout=5)


@pytest.mark.parametrize("arrives", ["before", "after"])
def test_unread_frames_end_the_session_when_every_frame_is_read(arrives):
    """With drop_unread=False a frame of a step the receiver left unread is a
    protocol error whether it arrived before or after the receiver moved on."""
    a, b = memory_pair(options=LinkOptions(drop_unread=False))
    if arrives == "before":
        a.send("extra", torch.zeros(1), step=0)
        a.send("act", torch.zeros(1), step=1)
        a.flush(5)
        message = "the peer sent tensor 'extra' step 0 micro 0, which this side"
    else:
        a.send("act", torch.zeros(1), step=0)
        b.recv("act", step=0, timeout=5)
        with pytest.raises(LinkTimeoutError):
            b.recv("act", step=1, timeout=0.1)  # b is at step 1 now
        a.send("extra", torch.zeros(1), step=0)
        message = "tensor 'extra' step 0 micro 0 arrived after this side moved on"
    with pytest.raises(FrameOrderError, match=message):
        b.recv("act", step=1, timeout=5)
    with pytest.raises(FrameError, match="never asked for"):
        a.recv("grad", step=1, timeout=5)
    a.close()
    b.close()


def test_step_going_backwards_on_the_wire_is_rejected():
    a, b = memory_pair()
    a.send("act", torch.zeros(1), step=3)
    b.recv("act", step=3, timeout=2)
    a._out_step = -1  # bypass the sender-side check to emulate a broken peer
    a.send("act", torch.zeros(1), step=2)
    with pytest.raises(FrameOrderError, match="arrived after step 3"):
        b.recv("act", step=4, timeout=2)
    a.close()
    b.close()


def test_duplicate_key_on_the_wire_is_rejected():
    a, b = memory_pair()
    a.send("act", torch.zeros(1), step=3)
    a._out_keys.clear()  # emulate a peer that replays a frame
    a.send("act", torch.zeros(1), step=3)
    with pytest.raises(FrameOrderError, match="duplicate tensor 'act' step 3"):
        b.recv("act", step=3, micro=1, timeout=2)
    a.close()
    b.close()


def test_pending_budget():
    opts = LinkOptions(max_pending_bytes=10_000)
    a, b = memory_pair(options=opts)
    a.send("a", torch.zeros(1000), step=0)  # 4 kB
    a.send("b", torch.zeros(1000), step=0)
    a.send("c", torch.zeros(1000), step=0)  # exceeds 10 kB unread
    with pytest.raises(FrameError, match="max_pending_bytes"):
        b.recv("c", step=0, timeout=2)
    a.close()
    b.close()


def test_close_is_graceful_and_sticky():
    a, b = memory_pair()
    a.send("act", torch.ones(3), step=0)
    a.close()
    a.close()  # idempotent
    assert torch.equal(b.recv("act", step=0, timeout=2), torch.ones(3))
    with pytest.raises(PeerLostError, match="peer closed the link"):
        b.recv("act", step=1, timeout=2)
    with pytest.raises(PeerLostError):
        b.send("grad", torch.ones(3), step=0)
    with pytest.raises(LinkClosedError):
        a.send("act", torch.ones(3), step=1)
    b.close()
    with pytest.raises(LinkClosedError):
        b.recv("act", step=1, timeout=1)


def test_context_manager_and_flush():
    a, b = memory_pair("fp16")
    with a, b:
        for m in range(8):
            a.send("act", torch.randn(256, 256), step=0, micro=m)
        a.flush(timeout=5)
        assert b.bytes_received == a.bytes_sent
