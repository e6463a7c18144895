"""TLS material for the gRPC link: loading PEM files and minting dev certificates.

Both parties authenticate each other with certificates signed by one CA they
agreed on (mutual TLS); the shared token in call metadata is a second factor
that also guards against a mis-issued certificate. :func:`make_dev_certs`
creates a throwaway CA plus one server and one client certificate for tests
and first experiments; production deployments bring their own PKI.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["DevCerts", "TlsConfig", "make_dev_certs", "write_token"]


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """One side's mTLS material, PEM-encoded.

    ``root_ca`` verifies the *peer's* certificate. ``server_name`` (client
    only) overrides the name checked against the server certificate when the
    address dialled is not one of its subject alternative names.
    """

    cert_chain: bytes
    private_key: bytes
    root_ca: bytes
    server_name: str | None = None

    @classmethod
    def from_files(
        cls,
        cert: str | os.PathLike[str],
        key: str | os.PathLike[str],
        ca: str | os.PathLike[str],
        server_name: str | None = None,
    ) -> TlsConfig:
        return cls(
            Path(cert).read_bytes(),
            Path(key).read_bytes(),
            Path(ca).read_bytes(),
            server_name,
        )

    def __repr__(self) -> str:  # never print key material into logs
        return f"TlsConfig(server_name={self.server_name!r}, private_key=<redacted>)"


@dataclass(frozen=True, slots=True)
class DevCerts:
    """Paths written by :func:`make_dev_certs`."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def at(
        cls,
        out_dir: str | os.PathLike[str],
        server: str = "server",
        client: str = "client",
    ) -> DevCerts:
        """The paths :func:`make_dev_certs` uses in ``out_dir`` (nothing is
        created): ``ca.pem``, ``SERVER.pem`` / ``.key``, ``CLIENT.pem`` / ``.key``."""
        out = Path(out_dir)
        return cls(
            ca_cert=out / "ca.pem",
            server_cert=out / f"{server}.pem",
            server_key=out / f"{server}.key",
            client_cert=out / f"{client}.pem",
            client_key=out / f"{client}.key",
        )

    @classmethod
    def for_parties(cls, out_dir: str | os.PathLike[str]) -> DevCerts:
        """The names the docs use (``aisyn certs``): the compute party or
        federated server is B (``b.pem``, ``b.key``), the data party or
        client A (``a.pem``, ``a.key``)."""
        return cls.at(out_dir, server="b", client="a")

    def files(self) -> tuple[Path, ...]:
        return (
            self.ca_cert,
            self.server_cert,
            self.server_key,
            self.client_cert,
            self.client_key,
        )

    def other_client(self, name: str) -> tuple[Path, Path]:
        """(certificate, key) of client ``name`` minted with
        ``make_dev_certs(..., more_clients=[name])``: another data party, say."""
        folder = self.ca_cert.parent
        return folder / f"client-{name}.pem", folder / f"client-{name}.key"

    def server_tls(self) -> TlsConfig:
        return TlsConfig.from_files(self.server_cert, self.server_key, self.ca_cert)

    def client_tls(self, server_name: str | None = None) -> TlsConfig:
        return TlsConfig.from_files(
            self.client_cert, self.client_key, self.ca_cert, server_name
        )


def make_dev_certs(
    out_dir: str | os.PathLike[str],
    hosts: Sequence[str] = ("127.0.0.1", "localhost"),
    *,
    days: int = 30,
    paths: DevCerts | None = None,
    more_clients: Sequence[str] = (),
) -> DevCerts:
    """Write a fresh CA, a server certificate valid for ``hosts`` and a client
    certificate into ``out_dir`` (under ``paths``' names, by default
    ``DevCerts.at``'s), and one more client certificate per name in
    ``more_clients`` (``DevCerts.other_client``). Keys are P-256 (fast to
    generate, supported by gRPC's BoringSSL) and written with mode 0600; the
    CA's key is never written, so nothing more can be signed with it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    # Back-date a little so a peer whose clock runs slightly behind accepts it.
    not_before, not_after = now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("aisyn link dev CA")
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key(), not_before, not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(
        common_name: str, usage: x509.ObjectIdentifier, sans: list[x509.GeneralName]
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            _builder(
                _name(common_name), ca_name, key.public_key(), not_before, not_after
            )
            .add_extension(
                x509.BasicConstraints(ca=False, path_length=None), critical=True
            )
            .add_extension(_key_usage(ca=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if sans:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(sans), critical=False
            )
        return builder.sign(ca_key, hashes.SHA256()), key

    server_cert, server_key = leaf(
        hosts[0] if hosts else "aisyn-server",
        ExtendedKeyUsageOID.SERVER_AUTH,
        [_general_name(h) for h in hosts],
    )
    client_cert, client_key = leaf("aisyn-client", ExtendedKeyUsageOID.CLIENT_AUTH, [])

    paths = paths or DevCerts.at(out)
    _write(paths.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM))
    _write(paths.server_cert, server_cert.public_bytes(serialization.Encoding.PEM))
    _write(paths.client_cert, client_cert.public_bytes(serialization.Encoding.PEM))
    _write(paths.server_key, _key_pem(server_key), private=True)
    _write(paths.client_key, _key_pem(client_key), private=True)
    for name in more_clients:
        cert, key = leaf(f"aisyn-client-{name}", ExtendedKeyUsageOID.CLIENT_AUTH, [])
        cert_path, key_path = paths.other_client(name)
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
        _write(key_path, _key_pem(key), private=True)
    return paths


def write_token(path: str | os.PathLike[str]) -> Path:
    """A fresh random token (256 bits, URL-safe text) for ``--token-file``,
    written with mode 0600: both parties of a split run give the same file."""
    path = Path(path)
    _write(path, (secrets.token_urlsafe(32) + "\n").encode(), private=True)
    return path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(
    subject: x509.Name,
    issuer: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    not_before: dt.datetime,
    not_after: dt.datetime,
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
    )


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=not ca,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes, *, private: bool = False) -> None:
    # Create private keys 0600 from the start rather than chmod after writing;
    # fchmod also tightens a pre-existing file that is being overwritten.
    mode = 0o600 if private else 0o644
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    os.fchmod(fd, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
