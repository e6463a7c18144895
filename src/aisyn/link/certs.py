"""TLS material for the gRPC link: loading PEM files and minting dev certificates.

Both parties authenticate each other with certificates signed by one CA they
agreed on (mutual TLS); the shared token in call metadata is a second factor
that also guards against a mis-issued certificate. :func:`make_dev_certs`
creates a throwaway CA plus one server and one client certificate for tests
and first experiments (and, asked to, keeps the CA's key so that
:func:`issue_client` can sign more client certificates: one per tenant of a
centre); production deployments bring their own PKI.

Credentials are written into their folder and never through a link in it: a
planted symbolic link (``token -> ../elsewhere``, ``a.key -> ../precious``)
is refused, and a file is replaced by renaming a fresh one over it, so
neither a symbolic nor a hard link carries a private key outside the folder.
The folder itself may be a link: the user named it (``creds ->
/secrets/creds`` is an ordinary layout); each file's temporary and its
rename are relative to one open handle of the folder, so they land together.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import os
import re
import secrets
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "DevCerts",
    "IssuedClient",
    "TlsConfig",
    "UnsafePathError",
    "issue_client",
    "make_dev_certs",
    "max_days",
    "write_token",
]

#: the last instant an X.509 validity period can name (GeneralizedTime's
#: four-digit year, RFC 5280 4.1.2.5)
LAST_DATE = dt.datetime(9999, 12, 31, 23, 59, 59, tzinfo=dt.UTC)
#: clients named like a party's or the CA's files would replace them
RESERVED_CLIENT_NAMES = frozenset({"a", "b", "ca"})


class UnsafePathError(ValueError):
    """A credential's path is a symbolic link: nothing is written through it."""


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

    @property
    def ca_key(self) -> Path:
        """Where ``make_dev_certs(..., keep_ca_key=True)`` keeps the CA's key
        (``ca.key`` beside ``ca.pem``)."""
        return self.ca_cert.with_suffix(".key")

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
    keep_ca_key: bool = False,
    overwrite: bool = True,
) -> DevCerts:
    """Write a fresh CA, a server certificate valid for ``hosts`` and a client
    certificate into ``out_dir`` (under ``paths``' names, by default
    ``DevCerts.at``'s), and one more client certificate per name in
    ``more_clients`` (``DevCerts.other_client``). Keys are P-256 (fast to
    generate, supported by gRPC's BoringSSL) and written with mode 0600. The
    CA's key is written (``DevCerts.ca_key``, 0600) only with
    ``keep_ca_key``; otherwise nothing more can be signed with it.

    Nothing is written if a target is a symbolic link (:class:`UnsafePathError`)
    or, without ``overwrite``, if one exists (``FileExistsError``)."""
    check_days(days)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = paths or DevCerts.at(out)
    targets = [*paths.files()]
    targets += [p for name in more_clients for p in paths.other_client(name)]
    if keep_ca_key:
        targets.append(paths.ca_key)
    check_targets(targets, overwrite=overwrite)
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
    ca = _Ca(ca_cert, ca_key)

    server_cert, server_key = ca.leaf(
        hosts[0] if hosts else "aisyn-server",
        ExtendedKeyUsageOID.SERVER_AUTH,
        [_general_name(h) for h in hosts],
        not_before,
        not_after,
    )
    client_cert, client_key = ca.leaf(
        "aisyn-client", ExtendedKeyUsageOID.CLIENT_AUTH, [], not_before, not_after
    )

    w = overwrite
    _write(paths.ca_cert, _cert_pem(ca_cert), replace=w)
    _write(paths.server_cert, _cert_pem(server_cert), replace=w)
    _write(paths.client_cert, _cert_pem(client_cert), replace=w)
    _write(paths.server_key, _key_pem(server_key), private=True, replace=w)
    _write(paths.client_key, _key_pem(client_key), private=True, replace=w)
    if keep_ca_key:
        _write(paths.ca_key, _key_pem(ca_key), private=True, replace=w)
    for name in more_clients:
        cert, key = ca.leaf(
            f"aisyn-client-{name}",
            ExtendedKeyUsageOID.CLIENT_AUTH,
            [],
            not_before,
            not_after,
        )
        cert_path, key_path = paths.other_client(name)
        _write(cert_path, _cert_pem(cert), replace=w)
        _write(key_path, _key_pem(key), private=True, replace=w)
    return paths


@dataclass(frozen=True, slots=True)
class IssuedClient:
    """What :func:`issue_client` wrote, and what a tenants file names it by."""

    cert: Path
    key: Path
    ca_cert: Path
    not_after: dt.datetime
    #: ``x509-sha256:<hex>``, the link's name for it (a tenant's ``certificate``)
    fingerprint: str
    #: RFC 4514 (a tenant's ``subject``)
    subject: str


def issue_client(
    folder: str | os.PathLike[str],
    name: str,
    *,
    days: int = 30,
    overwrite: bool = False,
) -> IssuedClient:
    """Sign a client certificate for ``name`` (subject ``CN=name``) with the CA
    ``make_dev_certs(..., keep_ca_key=True)`` left in ``folder`` (``ca.pem``,
    ``ca.key``), written as ``NAME.pem`` and ``NAME.key`` (0600). It ends
    ``days`` from now or when the CA does, whichever is first."""
    check_days(days)
    check_client_name(name)
    out = Path(folder)
    paths = DevCerts.at(out)
    if not os.path.lexists(paths.ca_key):
        raise FileNotFoundError(
            f"{paths.ca_key}: no CA key here, so no more certificates can be "
            f"signed by {paths.ca_cert} (`aisyn certs` keeps it only with "
            "--keep-ca-key); make a CA that can sign more with `aisyn certs --out "
            "NEW_FOLDER --keep-ca-key` or sign with your own PKI"
        )
    ca = _Ca.load(paths.ca_cert, paths.ca_key)
    cert_path, key_path = out / f"{name}.pem", out / f"{name}.key"
    check_targets([cert_path, key_path], overwrite=overwrite)
    now = dt.datetime.now(dt.UTC)
    ca_end = ca.cert.not_valid_after_utc
    if ca_end <= now:
        raise ValueError(
            f"{paths.ca_cert}: the CA expired on {ca_end:%Y-%m-%d %H:%M} UTC; make "
            "a new one with `aisyn certs --out NEW_FOLDER`"
        )
    not_after = min(now + dt.timedelta(days=days), ca_end)
    cert, key = ca.leaf(
        name,
        ExtendedKeyUsageOID.CLIENT_AUTH,
        [],
        now - dt.timedelta(minutes=5),
        not_after,
    )
    _write(cert_path, _cert_pem(cert), replace=overwrite)
    _write(key_path, _key_pem(key), private=True, replace=overwrite)
    return IssuedClient(
        cert=cert_path,
        key=key_path,
        ca_cert=paths.ca_cert,
        not_after=not_after,
        # The SHA-256 of the DER, as the link computes a peer's identity.
        fingerprint="x509-sha256:" + cert.fingerprint(hashes.SHA256()).hex(),
        subject=cert.subject.rfc4514_string(),
    )


def check_client_name(name: str) -> None:
    """A client's name is a plain file name, as a tenant's (it names its
    files, so nothing like ``../x``), and none of the parties' or the CA's,
    in any case."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}", name):
        raise ValueError(
            f"client {name!r}: a name is letters, digits, _ and - (up to 64), as "
            "a tenant's"
        )
    # (in any case: on a case-insensitive file system, as macOS's by
    # default, CA.key is ca.key)
    if name.lower() in RESERVED_CLIENT_NAMES:
        raise ValueError(
            f"client {name!r}: {', '.join(sorted(RESERVED_CLIENT_NAMES))} name the "
            "parties' and the CA's own files; pick another name"
        )


def max_days(now: dt.datetime | None = None) -> int:
    """The most whole days from ``now`` a certificate can be valid for."""
    return (LAST_DATE - (now or dt.datetime.now(dt.UTC))).days


def check_days(days: int) -> None:
    """Refuse a validity period X.509 cannot express (it ends by 9999-12-31)."""
    limit = max_days()
    if not 0 < days <= limit:
        raise ValueError(
            f"--days {days}: a certificate is valid from 1 day up to {limit} days "
            "from today (X.509 dates end at 9999-12-31)"
        )


def check_targets(paths: Iterable[Path], *, overwrite: bool) -> None:
    """Before anything is generated: refuse a target that is a symbolic link
    (even with ``overwrite``), and without ``overwrite`` one that exists."""
    paths = [Path(p) for p in paths]
    there = []
    for path in paths:
        if path.is_symlink():
            raise UnsafePathError(_link_message(path, os.readlink(path)))
        if os.path.lexists(path):
            there.append(path.name)
    if there and not overwrite:
        raise FileExistsError(
            f"{paths[0].parent}: already holds {', '.join(there)}; pass "
            "--overwrite to replace them (peers using the old ones will be refused)"
        )


def write_token(path: str | os.PathLike[str], *, overwrite: bool = True) -> Path:
    """A fresh random token (256 bits, URL-safe text) for ``--token-file``,
    written with mode 0600: both parties of a split run give the same file."""
    path = Path(path)
    token = (secrets.token_urlsafe(32) + "\n").encode()
    _write(path, token, private=True, replace=overwrite)
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


class _Ca:
    """A CA certificate and its key, signing leaves."""

    def __init__(self, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        self.cert, self.key = cert, key

    @classmethod
    def load(cls, cert_path: Path, key_path: Path) -> _Ca:
        try:
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        except ValueError:
            raise ValueError(f"{cert_path}: not a PEM certificate") from None
        try:
            key = serialization.load_pem_private_key(key_path.read_bytes(), None)
        except (ValueError, TypeError):  # TypeError: it wants a password
            raise ValueError(
                f"{key_path}: not an unencrypted PEM private key"
            ) from None
        if not isinstance(key, ec.EllipticCurvePrivateKey) or (
            key.public_key() != cert.public_key()
        ):
            raise ValueError(f"{key_path} is not the key of {cert_path}")
        return cls(cert, key)

    def leaf(
        self,
        common_name: str,
        usage: x509.ObjectIdentifier,
        sans: list[x509.GeneralName],
        not_before: dt.datetime,
        not_after: dt.datetime,
    ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            _builder(
                _name(common_name),
                self.cert.subject,
                key.public_key(),
                not_before,
                not_after,
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
        return builder.sign(self.key, hashes.SHA256()), key


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _link_message(path: Path, target: str) -> str:
    return (
        f"{path} is a symbolic link (to {target}); credentials are never written "
        "through one: remove it, or give another folder"
    )


def _write(
    path: Path, data: bytes, *, private: bool = False, replace: bool = True
) -> None:
    """Write ``data`` to ``path`` in its folder, never through a link there.

    Without ``replace`` the file is created exclusively (an existing name,
    dangling link included, is an error). With it, a fresh file beside it is
    renamed over it: the rename replaces the name itself, so a symbolic or
    hard link planted there carries nothing outside the folder, and a reader
    sees the old file or the new one, never half of one. Both are opened
    relative to the folder opened once, with O_NOFOLLOW.
    """
    # Private keys 0600 from the first byte rather than chmod after writing;
    # fchmod because the umask may have taken bits off the mode asked for.
    mode = 0o600 if private else 0o644
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISLNK(os.lstat(path.name, dir_fd=folder).st_mode):
                target = os.readlink(path.name, dir_fd=folder)
                raise UnsafePathError(_link_message(path, target))
        name = f".{path.name}.{secrets.token_hex(6)}.tmp" if replace else path.name
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        fd = os.open(name, flags, mode, dir_fd=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), mode)
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if replace:
                os.replace(name, path.name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=folder)
            raise
    finally:
        os.close(folder)
