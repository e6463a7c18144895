"""SuperNode authentication keys: one EC key pair per client organisation.

With TLS on, the SuperLink runs with ``--enable-supernode-auth``: it accepts
only SuperNodes whose public key was registered (``flwr supernode register``
over its Control API), and each SuperNode signs its requests with its private
key (``--auth-supernode-private-key``). Flower wants NIST-curve EC keys in
OpenSSH format; P-384 as in Flower's documentation. The private key stays with
its organisation (mode 0600); the server gets only the ``.pub`` file.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class NodeKeys:
    private: Path  # for the client's SuperNode
    public: Path  # for the server, to register


def make_node_keys(out_dir: str | Path, name: str) -> NodeKeys:
    """Write ``NAME.key`` (private, 0600) and ``NAME.pub`` into ``out_dir``."""
    if not _NAME.match(name):
        raise ValueError(f"{name!r}: a key name is letters, digits, '.', '_' or '-'")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    keys = NodeKeys(out / f"{name}.key", out / f"{name}.pub")
    for p in (keys.private, keys.public):
        if p.exists():
            raise FileExistsError(f"{p}: already exists; not overwriting a key")
    key = ec.generate_private_key(ec.SECP384R1())
    _write(
        keys.private,
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        ),
        mode=0o600,
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    _write(keys.public, public + f" aisyn-{name}\n".encode(), mode=0o644)
    return keys


def check_public_key(path: str | Path) -> Path:
    """``path`` if it holds an OpenSSH EC public key (what Flower registers)."""
    p = Path(path)
    try:
        key = serialization.load_ssh_public_key(p.read_bytes())
    except FileNotFoundError:
        raise FileNotFoundError(f"{p}: public key not found") from None
    except (ValueError, OSError) as e:
        raise ValueError(f"{p}: not an OpenSSH public key ({e})") from None
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise ValueError(f"{p}: not an EC public key (make one: aisyn fl keygen)")
    return p


def check_private_key(path: str | Path) -> Path:
    """``path`` if it holds an OpenSSH EC private key (a SuperNode signs with it)."""
    p = Path(path)
    try:
        key = serialization.load_ssh_private_key(p.read_bytes(), None)
    except FileNotFoundError:
        raise FileNotFoundError(f"{p}: private key not found") from None
    except (ValueError, TypeError, OSError) as e:
        raise ValueError(f"{p}: not an unencrypted OpenSSH private key ({e})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{p}: not an EC private key (make one: aisyn fl keygen)")
    return p


def _write(path: Path, data: bytes, *, mode: int) -> None:
    # Created with its mode from the start: a private key is never world-readable.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
