"""Why a TLS connection to a link server fails, when waiting will not help.

gRPC reports a certificate that does not match the address dialled, a CA the
client does not trust, an expired certificate, or a client certificate the
server refuses as UNAVAILABLE -- the same status as a server not up yet -- so
``connect`` retried them for its whole timeout, one warning per attempt. This
module tells the two apart: it checks the client's own certificate before
dialling, and on a failure it makes one handshake of its own with the same
certificates, whose outcome names the cause. A server that cannot be reached,
or that completes the handshake, is left to the retries.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import socket
import ssl
import time

from cryptography import x509

from aisyn.net import split_host_port

from .certs import TlsConfig
from .data_plane import tls_context
from .errors import CertificateError

__all__ = [
    "certificate_hosts",
    "check_own_certificate",
    "diagnose",
    "permanent_failure",
]

#: what an HTTP/2 client sends first: a gRPC server answers it with SETTINGS,
#: and only after it has accepted the client's certificate (TLS 1.3 checks
#: that after the client's side of the handshake is done)
_HTTP2_PREFACE = (
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
)
#: OpenSSL's verify codes for a name or address the certificate does not cover
_NAME_MISMATCH = {62, 64}  # X509_V_ERR_HOSTNAME_MISMATCH, _IP_ADDRESS_MISMATCH
_EXPIRED, _NOT_YET_VALID = 10, 9


def certificate_hosts(der: bytes) -> list[str]:
    """The DNS names and IP addresses a certificate is valid for."""
    try:
        cert = x509.load_der_x509_certificate(der)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except (ValueError, x509.ExtensionNotFound):
        return []
    names = sans.value.get_values_for_type(x509.DNSName)
    addresses = [str(ip) for ip in sans.value.get_values_for_type(x509.IPAddress)]
    return [*names, *addresses]


def _first_pem(chain: bytes) -> x509.Certificate | None:
    try:
        return x509.load_pem_x509_certificate(chain)
    except ValueError:
        return None


def check_own_certificate(tls: TlsConfig, now: dt.datetime | None = None) -> None:
    """Raise CertificateError if this side's certificate is expired or not
    yet valid: no server will accept it, however often it is presented."""
    cert = _first_pem(tls.cert_chain)
    if cert is None:
        return  # the TLS library will say what is wrong with it
    now = now or dt.datetime.now(dt.UTC)
    if now > cert.not_valid_after_utc:
        raise CertificateError(
            f"our certificate expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} "
            "UTC: issue a new one (aisyn certs)",
            kind="expired",
        )
    if now < cert.not_valid_before_utc:
        raise CertificateError(
            "our certificate is not valid before "
            f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC (is this "
            "machine's clock right?)",
            kind="not-yet-valid",
        )


def _server_certificate(host: str, port: int, name: str, timeout: float) -> bytes:
    """The server's certificate as it presents it, unverified (to name its
    hosts in the message); empty if it cannot be had."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with contextlib.suppress(OSError, ssl.SSLError):
        with socket.create_connection((host, port), timeout=timeout) as raw:
            with ctx.wrap_socket(raw, server_hostname=name) as sock:
                return sock.getpeercert(binary_form=True) or b""
    return b""


def diagnose(
    address: str, tls: TlsConfig, timeout: float = 5.0
) -> CertificateError | None:
    """One handshake with the server at ``address`` as ``connect`` makes it:
    a CertificateError naming the cause if the certificates cannot work,
    None if they do or the server could not be reached (either may heal)."""
    host, port = split_host_port(address)
    name = tls.server_name or host
    ctx = tls_context(tls, server=False)
    ctx.set_alpn_protocols(["h2"])
    try:
        raw = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return None
    with raw:
        try:
            sock = ctx.wrap_socket(raw, server_hostname=name)
        except ssl.SSLCertVerificationError as exc:
            return _verify_failed(exc, address, host, port, name, timeout)
        except ssl.SSLError as exc:
            return _refused_us(exc, address)
        except OSError:
            return None
        with sock:
            try:
                sock.settimeout(min(timeout, 2.0))
                sock.sendall(_HTTP2_PREFACE)
                answered = sock.recv(1)
            except ssl.SSLError as exc:
                return _refused_us(exc, address)
            except OSError:
                return None
    if answered:
        return None
    # Closed right after the handshake, before a word of HTTP/2: how a gRPC
    # server under TLS 1.3 refuses a client certificate (its alert is not
    # always what arrives first).
    return CertificateError(
        f"{address} closed the connection after the TLS handshake: it does "
        "not accept our certificate (signed by a CA it does not trust, or "
        "expired)",
        kind="refused",
    )


def _verify_failed(
    exc: ssl.SSLCertVerificationError,
    address: str,
    host: str,
    port: int,
    name: str,
    timeout: float,
) -> CertificateError:
    der = _server_certificate(host, port, name, timeout)
    hosts = certificate_hosts(der) if der else []
    listed = ", ".join(hosts) if hosts else "no host names"
    if exc.verify_code in _NAME_MISMATCH:
        return CertificateError(
            f"the certificate of {address} is for {listed}, not {name}",
            kind="name",
            hosts=hosts,
            dialled=name,
            port=port,
        )
    if exc.verify_code in (_EXPIRED, _NOT_YET_VALID):
        cert = x509.load_der_x509_certificate(der) if der else None
        when = (
            f" (valid {cert.not_valid_before_utc:%Y-%m-%d} to "
            f"{cert.not_valid_after_utc:%Y-%m-%d})"
            if cert is not None
            else ""
        )
        return CertificateError(
            f"the certificate of {address} (for {listed}) {exc.verify_message}{when}",
            kind="expired",
            hosts=hosts,
            dialled=name,
            port=port,
        )
    return CertificateError(
        f"the certificate of {address} (for {listed}) is not signed by our CA "
        f"({exc.verify_message}): both parties need the same ca.pem",
        kind="untrusted",
        hosts=hosts,
        dialled=name,
        port=port,
    )


def _refused_us(exc: ssl.SSLError, address: str) -> CertificateError | None:
    """A TLS alert from the server: it refused our certificate."""
    reason = str(exc.reason or "")
    if "ALERT" not in reason.upper():
        return None
    return CertificateError(
        f"{address} refused our certificate ({reason.lower().replace('_', ' ')}): "
        "it needs one signed by the CA the server trusts, and current",
        kind="refused",
    )


def permanent_failure(
    peer: str, tls: TlsConfig | None, budget: float
) -> CertificateError | None:
    """The certificate problem behind a failed attempt to reach ``peer``, if
    that is what it was (gRPC reports it as UNAVAILABLE, as it does a server
    not up yet), as the error ``connect`` raises; ``budget``: seconds left."""
    if tls is None:
        return None
    # (at most ~5 s per handshake, within what is left of connect's timeout)
    timeout = max(0.5, min(5.0, budget / 2))
    found = diagnose(peer, tls, timeout)
    if found is not None and found.kind == "refused":
        # A server closing right after the handshake may also be one going
        # down: believe it only twice in a row.
        time.sleep(0.2)
        found = diagnose(peer, tls, timeout)
    if found is None:
        return None
    return type(found)(
        f"TLS with {peer} failed: {found}",
        kind=found.kind,
        hosts=found.hosts,
        dialled=found.dialled,
        port=found.port,
    )
