"""Network addresses: ``HOST:PORT`` parsing, loopback, free ports.

One home for the rule that decides where plaintext is allowed (loopback
only, unless forced): the split link, ``aisyn split`` and Flower's processes
all ask :func:`is_loopback`, so the three cannot disagree on what counts.
"""

from __future__ import annotations

import ipaddress
import random
import socket
from pathlib import Path


def split_host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` / ``"[v6]:port"`` -> (host without brackets, port);
    ValueError if malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{address!r}: expected HOST:PORT")
    return host.removeprefix("[").removesuffix("]"), int(port)


def join_host_port(host: str, port: int) -> str:
    """The inverse of :func:`split_host_port` (brackets around an IPv6 host)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback IP (``127.0.0.0/8``, ``::1``; brackets allowed).

    Other names are not resolved: a name that resolves to loopback today may
    not tomorrow, so it counts as remote.
    """
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        return False
    return ip.is_loopback


#: where the kernel draws the source ports of outgoing connections (Linux's
#: default; read from /proc where it exists)
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_ports() -> tuple[int, int]:
    """(low, high) of the source ports the kernel gives outgoing connections."""
    try:
        low, high = map(int, EPHEMERAL_RANGE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


_PORT_DRAWS = random.SystemRandom()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now, chosen below the kernel's ephemeral
    range: a port from inside it (what binding port 0 returns) can be taken
    as the source port of any outgoing connection between this call and the
    caller's bind -- torchrun's store then fails with EADDRINUSE. Outside
    the range only a deliberate bind can take it. Random, so that callers
    racing each other rarely pick the same one -- from the OS's entropy, not
    the ``random`` module's state, which a caller's ``random.seed`` would make
    the same in two processes."""
    low, _ = ephemeral_ports()
    for _ in range(64):
        port = _PORT_DRAWS.randrange(10_000, low) if low > 11_000 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
