"""aisyn.net: the one loopback rule the link, split and fl all use."""

from __future__ import annotations

import random
import socket

import pytest

from aisyn.net import (
    ephemeral_ports,
    free_port,
    is_loopback,
    split_host_port,
)


@pytest.mark.parametrize(
    "host", ["localhost", "127.0.0.1", "127.8.9.10", "::1", "[::1]"]
)
def test_loopback_hosts(host):
    assert is_loopback(host)


@pytest.mark.parametrize(
    "host", ["10.0.0.1", "0.0.0.0", "::", "example.org", "localhost.example.org", ""]
)
def test_other_hosts_are_remote(host):
    # names are not resolved: only "localhost" itself counts
    assert not is_loopback(host)


def test_split_host_port():
    assert split_host_port("127.0.0.1:50051") == ("127.0.0.1", 50051)
    assert split_host_port("[::1]:9092") == ("::1", 9092)
    for bad in ["127.0.0.1", ":80", "host:", "host:x"]:
        with pytest.raises(ValueError, match="expected HOST:PORT"):
            split_host_port(bad)


def test_free_port_can_be_bound_and_no_outgoing_connection_takes_it():
    """Below the ephemeral range: binding port 0 handed torchrun a port an
    outgoing connection took first (EADDRINUSE in CI)."""
    port = free_port()
    low, high = ephemeral_ports()
    assert not low <= port <= high, (port, low, high)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_seeded_random_module_does_not_choose_the_port():
    """Two processes that seeded ``random`` alike (a test does, for a server's
    draws) must not race each other for the same port: the tests run on two
    workers at once."""
    state = random.getstate()
    try:
        ports = set()
        for _ in range(3):
            random.seed(0)
            ports.add(free_port())
    finally:
        random.setstate(state)
    assert len(ports) > 1
