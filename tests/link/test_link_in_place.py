"""A tensor modified in place after ``send()``: the peer gets the original or
the link fails with a reason, on every transport.

The sender reads a tensor's memory after ``send()`` returned (that is what
makes sending asynchronous). The guard compares the tensor's version counter
after the last read with the one ``send()`` saw. Torch bumps that counter when
an in-place op *finishes*, so the tests hold the sender until the caller's
modification is done; a modification racing the read itself is the caller's
bug the guard cannot always see (as with ``torch.distributed.isend``), which
``Link.send`` documents.
"""

from __future__ import annotations

import threading

import pytest
import torch
from linkutil import transport_pair

from aisyn.link import Link, LinkError

# (transport, codec). In memory, codec "none" hands the peer the sender's own
# tensor (zero copy), so there is nothing to guard there.
CASES = [
    ("memory", "int8"),
    ("grpc", "none"),
    ("grpc", "int8"),
    ("data-plane", "none"),
    ("data-plane", "fp16"),
]


def _hold_sender(link: Link) -> threading.Event:
    """Make ``link``'s sender wait at its next write until the returned event
    is set, so nothing queued behind that write has been read yet."""
    gate = threading.Event()
    write = link._write

    def held(frame):
        assert gate.wait(10), "the test never let the sender go"
        return write(frame)

    link._write = held
    return gate


@pytest.mark.parametrize(("transport", "codec"), CASES)
def test_modified_before_it_was_read_fails_the_link(transport, codec):
    with transport_pair(transport) as (a, b):
        gate = _hold_sender(a)
        # Too big to go inline, and in the codec under test: in memory, codec
        # none hands the tensor over without a write, so it would not wait.
        a.send("first", torch.zeros(100_000), step=0, codec=codec)
        x = torch.randn(1_000_000)
        a.send("act", x, step=0, codec=codec)
        x.add_(1)  # done before the sender reads x: it must notice
        gate.set()
        with pytest.raises(LinkError, match="modified in place"):  # told why
            b.recv("act", step=0, timeout=5)


@pytest.mark.heavy
@pytest.mark.parametrize(("transport", "codec"), CASES)
def test_modified_after_flush_the_peer_has_the_original(transport, codec):
    with transport_pair(transport) as (a, b):
        x = torch.randn(1_000_000)
        original = x.clone()
        a.send("act", x, step=0, codec=codec)
        a.flush(timeout=5)
        x.add_(1)
        y = b.recv("act", step=0, timeout=5)
        assert float((y - original).norm() / original.norm()) < 0.01
