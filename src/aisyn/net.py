"""Network addresses: ``HOST:PORT`` parsing, loopback, free ports.

One home for the rule that decides where plaintext is allowed (loopback
only, unless forced): the split link, ``aisyn split`` and Flower's processes
all ask :func:`is_loopback`, so the three cannot disagree on what counts.
"""

from __future__ import annotations

import ipaddress
import socket


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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (free until someone binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
