"""How a split party reaches its peer: addresses, mTLS files, the token, and
how long each side waits for the other.

Secrets never go on a command line (``ps`` shows it) or into a run folder:
the token comes from a file (``--token-file``) or the ``AISYN_SPLIT_TOKEN``
environment variable, and run folders record only file paths.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

from aisyn.link.base import LinkOptions
from aisyn.link.certs import TlsConfig
from aisyn.net import is_loopback, split_host_port

TOKEN_ENV = "AISYN_SPLIT_TOKEN"

# A dead peer or network is noticed by keepalive within seconds; these bound
# the wait for a live peer that stopped talking (a bug, a deadlock, a client
# that holds the server). Generous, because a false alarm ends a training run.

#: The data party's longest wait for one message of the compute party: B's
#: compute of one micro-batch (or of a step's gradient norm), or B writing its
#: half of a checkpoint, which for a large model is the longest.
DATA_PARTY_RECV_TIMEOUT_S = 1800.0
#: The compute party's longest wait for the data party, mostly between rounds
#: while A writes its own checkpoint, evaluates or plots.
COMPUTE_PARTY_IDLE_TIMEOUT_S = 1800.0
#: ... and for its first round after the hello: A only loads its half of the
#: model (or a checkpoint) first. Short, so that a data party that sends a
#: hello and stays silent holds the one session slot for a minute, not for
#: the idle timeout, while others queue.
COMPUTE_PARTY_HELLO_TIMEOUT_S = 60.0
#: How long the data party tries to open a session: past one hello timeout
#: (and a queued party is let in next), so that a silent squatter cannot
#: make it give up; a session busy training holds B longer, as it should.
DATA_PARTY_CONNECT_TIMEOUT_S = 2 * COMPUTE_PARTY_HELLO_TIMEOUT_S + 30.0


@dataclass(frozen=True)
class LinkSettings:
    """One side's connection settings (A dials ``address``, B listens on it)."""

    address: str
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    server_name: str | None = None
    token_file: str | None = None
    insecure: bool = False
    allow_insecure_remote: bool = False
    #: the bulk data plane (``link/data_plane.py``): where B offers it
    #: (``--data-listen``), or where A dials it when not at ``address``'s host
    #: and the port B names (``--data-peer``: a proxy or NAT between)
    data_address: str | None = None

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.tls_cert, self.tls_key, self.tls_ca)]
        if any(given) and not all(given):
            raise ValueError("mutual TLS needs all of --tls-cert, --tls-key, --tls-ca")
        if all(given) and self.insecure:
            raise ValueError("give either the --tls-* files or --insecure, not both")
        if not all(given) and not self.insecure:
            raise ValueError(
                "the link needs mutual TLS (--tls-cert, --tls-key, --tls-ca); "
                "plaintext only with --insecure (loopback only unless forced)"
            )

    def validate(self) -> None:
        """Fail early (before any run folder is written) on bad settings."""
        self.tls()
        self.token()
        for address in filter(None, (self.address, self.data_address)):
            host = split_host_port(address)[0]
            if (
                self.insecure
                and not self.allow_insecure_remote
                and not is_loopback(host)
            ):
                raise ValueError(
                    f"refusing plaintext to non-loopback {address}: use mutual TLS "
                    "(activations and gradients reveal training data), or force it "
                    "with --allow-insecure-remote"
                )

    def tls(self) -> TlsConfig | None:
        if self.insecure:
            return None
        assert self.tls_cert and self.tls_key and self.tls_ca
        for label, path in (
            ("--tls-cert", self.tls_cert),
            ("--tls-key", self.tls_key),
            ("--tls-ca", self.tls_ca),
        ):
            if not Path(path).is_file():
                raise FileNotFoundError(f"{label} {path}: no such file")
        return TlsConfig.from_files(
            self.tls_cert, self.tls_key, self.tls_ca, self.server_name
        )

    def token(self) -> str:
        if self.token_file is not None:
            path = Path(self.token_file)
            if not path.is_file():
                raise FileNotFoundError(f"--token-file {path}: no such file")
            token = path.read_text(encoding="utf-8").strip()
            if not token:
                raise ValueError(f"--token-file {path}: empty")
            return token
        token = os.environ.get(TOKEN_ENV, "").strip()
        if not token:
            raise ValueError(
                f"no shared token: give --token-file FILE or set {TOKEN_ENV}"
            )
        return token

    def has_token(self) -> bool:
        """Whether a shared token is configured (a file, or the variable)."""
        configured = os.environ.get(TOKEN_ENV, "").strip()
        return self.token_file is not None or bool(configured)

    def security(self, *, token_required: bool = True) -> dict:
        """The token, TLS and plaintext arguments of either end of the link
        (``GrpcLinkServer``, ``grpc_link.connect``). Without
        ``token_required`` (a server whose tenants have tokens of their own)
        the token is "" when none is configured."""
        return dict(
            token=self.token() if token_required or self.has_token() else "",
            tls=self.tls(),
            insecure=self.insecure,
            allow_insecure_remote=self.allow_insecure_remote,
        )

    def to_dict(self) -> dict:
        """For run folders: paths and flags only, never the token itself."""
        return {
            k: (str(Path(v).resolve()) if k.startswith(("tls_", "token")) and v else v)
            for k, v in asdict(self).items()
        }

    @classmethod
    def from_dict(cls, d: dict) -> LinkSettings:
        return cls(**d)


def link_options(
    codec: str = "none", recv_timeout_s: float | None = DATA_PARTY_RECV_TIMEOUT_S
) -> LinkOptions:
    """Link options of a split session; ``recv_timeout_s`` None waits forever."""
    # drop_unread=False: both parties read every frame the other sends, so a
    # frame of a step already left means they disagree on the protocol's state;
    # end the session at once rather than wait for a frame that never comes.
    return LinkOptions(codec=codec, recv_timeout_s=recv_timeout_s, drop_unread=False)


def parse_timeout(text: str) -> float | None:
    """A timeout flag's value: seconds > 0, or 0 / "none" to wait forever."""
    if text.strip().lower() == "none":
        return None
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"timeout {text!r}: give seconds, or 0 / none") from None
    if seconds == 0:
        return None
    if not 0 < seconds < float("inf"):
        raise ValueError(f"timeout {text!r}: give seconds > 0, or 0 / none")
    return seconds
