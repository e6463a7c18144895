"""A compute centre's data owners: who each tenant is, and what it may use.

``aisyn split serve --tenants tenants.toml`` reads one table per tenant::

    [tenant.hospital]
    certificate = "x509-sha256:3f2a..."  # its client certificate's fingerprint,
    # or certificate_file = "hospital.pem", or subject = "CN=hospital,O=..."
    token_file = "hospital.token"        # its own token (default: the server's)
    weight = 2                           # its share when tenants compete
    max_sessions = 2                     # sessions open at once
    memory = "8GB"                       # what its sessions may hold at B
    steps_per_hour = 600                 # training steps in any hour

A tenant is recognised by what the link proves -- its client certificate,
its token, or both, and when a tenant names both, both must be its own (a
stolen token from another's certificate is refused). Its runs live under
``OUT/<tenant>/<run id>/`` and are bound to the tenant, so another tenant
presenting the same run id reaches a folder of its own, never this one.
Quotas are checked when a session opens (sessions, memory) and before each
training step (steps per hour); a refusal names the quota and the numbers,
and leaves every checkpoint as it was.
"""

from __future__ import annotations

import collections
import math
import re
import ssl
import threading
import time
import tomllib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

from aisyn.link import PeerHello, certificate_identity, token_identity
from aisyn.model.cost import PlanError, format_bytes, parse_bytes
from aisyn.split.centre.fair_share import FairShare

#: A tenant's name is a folder name: no separators, no dots first.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
FINGERPRINT = re.compile(r"x509-sha256:[0-9a-f]{64}")
#: The biggest file a tenant's token or certificate may be read from.
MAX_CREDENTIAL_BYTES = 64 * 1024
#: The most tenants one file may name.
MAX_TENANTS = 10_000
FIELDS = {
    "certificate",
    "certificate_file",
    "subject",
    "token_file",
    "weight",
    "max_sessions",
    "memory",
    "steps_per_hour",
}
#: a run's owner, in B's run config.json, when tenants are served
OWNER_PREFIX = "tenant:"
HOUR_S = 3600.0


class TenantError(ValueError):
    """A tenants file that cannot be used, or a peer no tenant owns."""


class QuotaError(ValueError):
    """A tenant (or the server) is at a quota: the reason names it, and
    ``quota`` which one (``sessions``, ``run``, ``server_sessions``,
    ``memory``, ``server_memory``, ``steps_per_hour``)."""

    def __init__(self, message: str, quota: str) -> None:
        super().__init__(message)
        self.quota = quota


@dataclass(frozen=True)
class Tenant:
    name: str
    #: ``x509-sha256:<hex>`` of its client certificate ("" if none)
    certificate: str = ""
    #: its certificate's subject, RFC 4514 ("" if none)
    subject: str = ""
    #: ``token-sha256:<hex>`` of its own token ("" if it uses the server's)
    token: str = ""
    weight: float = 1.0
    max_sessions: int = 1
    memory_bytes: float = math.inf
    steps_per_hour: int | None = None
    #: the token itself, for the link server to accept (never logged)
    token_secret: str = field(default="", repr=False)

    @property
    def label(self) -> str:
        """How messages name it (the nameless pool: "the data party")."""
        return f"tenant {self.name}" if self.name else "the data party"

    @property
    def owner(self) -> str:
        """What its runs are bound to (survives a new certificate)."""
        return OWNER_PREFIX + self.name


class Tenants:
    """The tenants of one compute party, by name, certificate and token."""

    def __init__(self, tenants: list[Tenant]) -> None:
        self.by_name = {t.name: t for t in tenants}
        self._by_cert = {t.certificate: t for t in tenants if t.certificate}
        self._by_subject = {t.subject: t for t in tenants if t.subject}
        self._by_token = {t.token: t for t in tenants if t.token}

    def __len__(self) -> int:
        return len(self.by_name)

    def token_secrets(self) -> list[str]:
        """The tenants' own tokens, for the link server to accept."""
        return [t.token_secret for t in self.by_name.values() if t.token_secret]

    def resolve(self, peer: PeerHello) -> Tenant:
        """The tenant ``peer`` is, as its link proves it; TenantError naming
        the problem if none, or if its credentials are not one tenant's."""
        has_cert = peer.identity.startswith("x509-sha256:")
        by_cert = self._by_cert.get(peer.identity) if has_cert else None
        by_subject = self._by_subject.get(peer.subject) if peer.subject else None
        if by_cert and by_subject and by_cert is not by_subject:
            raise TenantError(
                f"this client certificate is tenant {by_cert.name}'s by its "
                f"fingerprint and tenant {by_subject.name}'s by its subject"
            )
        cert_tenant = by_cert or by_subject
        token_tenant = self._by_token.get(peer.token_identity)
        if cert_tenant and token_tenant and cert_tenant is not token_tenant:
            raise TenantError(
                f"the token presented is tenant {token_tenant.name}'s but the "
                f"client certificate is tenant {cert_tenant.name}'s"
            )
        tenant = cert_tenant or token_tenant
        if tenant is None:
            subject = peer.subject or "no subject"
            what = (
                f"client certificate ({peer.identity[:24]}..., {subject})"
                if has_cert
                else "token"
            )
            raise TenantError(f"no tenant of this compute party owns this {what}")
        if tenant.token and token_tenant is not tenant:
            raise TenantError(
                f"tenant {tenant.name} must present its own token, not the "
                "server's shared one"
            )
        if (tenant.certificate or tenant.subject) and cert_tenant is not tenant:
            raise TenantError(
                f"tenant {tenant.name} must present its own client certificate"
            )
        return tenant


def load_tenants(path: str | Path) -> Tenants:
    """Read and check a tenants file; TenantError with one line naming the
    file, the tenant and the field of the first problem."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        # Duplicate tables ([tenant.x] twice) are a TOML error too.
        raise TenantError(f"{path}: not a valid TOML file: {e}") from None
    except OSError as e:
        raise TenantError(f"{path}: {e.strerror or e}") from None
    if set(data) - {"tenant"}:
        raise TenantError(
            f"{path}: unknown table(s) {sorted(set(data) - {'tenant'})}; "
            "tenants are [tenant.NAME] tables"
        )
    table = data.get("tenant")
    if not isinstance(table, dict) or not table:
        raise TenantError(f"{path}: no [tenant.NAME] table")
    if len(table) > MAX_TENANTS:
        raise TenantError(f"{path}: {len(table)} tenants, at most {MAX_TENANTS}")
    tenants = [_tenant(path, name, fields) for name, fields in table.items()]
    for attr, what in (
        ("certificate", "client certificate"),
        ("subject", "certificate subject"),
        ("token", "token"),
    ):
        seen: dict[str, str] = {}
        for t in tenants:
            value = getattr(t, attr)
            if not value:
                continue
            if value in seen:
                raise TenantError(
                    f"{path}: tenants {seen[value]} and {t.name} have the same {what}"
                )
            seen[value] = t.name
    return Tenants(tenants)


def _tenant(path: Path, name: str, fields: object) -> Tenant:
    where = f"{path}: tenant {name!r}"
    if not NAME.fullmatch(name):
        raise TenantError(
            f"{where}: a name is 1-64 letters, digits, '_' or '-', starting "
            "with a letter or digit (it names the tenant's folder)"
        )
    if not isinstance(fields, dict):
        raise TenantError(f"{where}: expected a table of fields")
    if unknown := sorted(set(fields) - FIELDS):
        raise TenantError(
            f"{where}: unknown field(s) {unknown}; known: {', '.join(sorted(FIELDS))}"
        )

    def text(key: str) -> str:
        value = fields.get(key, "")
        if not isinstance(value, str):
            raise TenantError(f"{where}: {key} must be a string")
        return value

    certificate = text("certificate")
    if certificate and not FINGERPRINT.fullmatch(certificate):
        raise TenantError(
            f"{where}: certificate must be x509-sha256:<64 lowercase hex digits> "
            "(or give certificate_file)"
        )
    if file := text("certificate_file"):
        if certificate:
            raise TenantError(
                f"{where}: give certificate or certificate_file, not both"
            )
        pem = _read_small(path.parent / file, where, "certificate_file")
        try:
            certificate = certificate_identity(ssl.PEM_cert_to_DER_cert(pem))
        except ValueError:
            raise TenantError(
                f"{where}: certificate_file {file}: not a PEM certificate"
            ) from None
    token = ""
    if file := text("token_file"):
        secret = _read_small(path.parent / file, where, "token_file").strip()
        if not secret or not (secret.isascii() and secret.isprintable()):
            raise TenantError(
                f"{where}: token_file {file}: a token is one line of printable ASCII"
            )
        token = token_identity(secret)
    else:
        secret = ""
    subject = text("subject")
    if not (certificate or subject or token):
        raise TenantError(
            f"{where}: nothing identifies it: give certificate, certificate_file, "
            "subject or token_file"
        )
    memory = fields.get("memory", math.inf)
    try:
        memory = parse_bytes(memory) if isinstance(memory, str) else memory
    except PlanError as e:
        raise TenantError(f"{where}: memory: {e}") from None
    return Tenant(
        name,
        certificate,
        subject,
        token,
        weight=_positive(fields, "weight", 1.0, where),
        max_sessions=int(_positive(fields, "max_sessions", 1, where, whole=True)),
        memory_bytes=_positive({"memory": memory}, "memory", math.inf, where, inf=True),
        steps_per_hour=(
            int(_positive(fields, "steps_per_hour", 0, where, whole=True))
            if "steps_per_hour" in fields
            else None
        ),
        token_secret=secret,
    )


def _positive(
    fields: dict,
    key: str,
    default: float,
    where: str,
    *,
    whole: bool = False,
    inf: bool = False,
) -> float:
    value = fields.get(key, default)
    kind = "a positive whole number" if whole else "a positive number"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TenantError(f"{where}: {key} must be {kind}, got {value!r}")
    if whole and not isinstance(value, int):
        raise TenantError(f"{where}: {key} must be {kind}, got {value!r}")
    if not value > 0 or math.isnan(value) or (math.isinf(value) and not inf):
        raise TenantError(f"{where}: {key} must be {kind}, got {value!r}")
    if whole and value > 1 << 40:
        raise TenantError(f"{where}: {key} {value} is absurdly large")
    return value


def _read_small(file: Path, where: str, key: str) -> str:
    try:
        if file.stat().st_size > MAX_CREDENTIAL_BYTES:
            raise TenantError(f"{where}: {key} {file}: larger than a credential")
        return file.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or e
        raise TenantError(f"{where}: {key} {file}: {reason}") from None


# ------------------------------------------------------------------ the ledger


class Lease:
    """One open session's hold on its tenant's quotas; ``close()`` (once or
    more) gives it back."""

    def __init__(self, usage: Usage, tenant: Tenant, run_id: str, memory: float):
        self._usage = usage
        self.tenant = tenant
        self.run_id = run_id
        self.memory_bytes = memory
        #: what the session holds whatever its rounds (weights, gradients,
        #: optimizer state); its rounds' activations come on top
        self.fixed_bytes = memory
        #: called with each round's figures (``TenantMetrics.round``), if set
        self.on_round: Callable[..., None] | None = None
        #: called once when the lease is given back, if set
        self.on_close: Callable[[], None] | None = None
        #: called with the quota's name when a step is refused, if set
        self.on_refused: Callable[[str], None] | None = None
        #: a TRAIN round's memory at B, from (micro-batches, rows, seq len,
        #: window); None where no budget asks for it
        self.round_bytes: Callable[[int, int, int, int], float] | None = None
        #: called with the bytes the lease grew by, if set (the metrics)
        self.on_grow: Callable[[float], None] | None = None
        self._closed = False

    def compute(self) -> AbstractContextManager[None]:
        """A turn at B's compute, shared among tenants by weight
        (``split.centre.fair_share``)."""
        return self._usage.fair.turn(self.tenant.name, self.tenant.weight)

    def fits_round(self, micro_batches: int, rows: int, seq_len: int, window: int):
        """Grow the lease to what a TRAIN round of this size holds at B, if
        more than it holds; QuotaError (nothing of the round done) if that
        passes the tenant's or the server's memory."""
        if self.round_bytes is None:
            return
        need = self.fixed_bytes + self.round_bytes(micro_batches, rows, seq_len, window)
        if need > self.memory_bytes:
            try:
                self._usage._grow(self, need)
            except QuotaError:
                if self.on_refused is not None:
                    self.on_refused("memory")
                raise

    def before_step(self) -> None:
        """Count one training step; QuotaError if the tenant's steps in the
        last hour are used up (nothing of the step has happened yet)."""
        self._usage._step(self.tenant)

    def close(self) -> None:
        with self._usage._lock:
            if self._closed:
                return
            self._closed = True
        # The session stays open until its line is written: whoever waits for
        # the centre to drain then finds every ended session recorded.
        try:
            if self.on_close is not None:
                self.on_close()
        finally:
            self._usage._close(self)


class Usage:
    """What every tenant holds now: sessions, memory, steps of the last hour.

    Thread-safe: the sessions run on threads of their own. ``max_sessions``
    and ``memory_bytes`` bound the whole server."""

    def __init__(
        self,
        max_sessions: int = 1,
        memory_bytes: float = math.inf,
        clock: Callable[[], float] = time.monotonic,
        settle_s: float = 5.0,
        slots: int | None = None,
    ) -> None:
        self.max_sessions = max_sessions
        self.memory_bytes = memory_bytes
        #: held for all sessions, counted once against ``memory_bytes`` (the
        #: base the LoRA sessions share)
        self.resident_bytes = 0.0
        self._clock = clock
        #: how long a session that would be over a quota waits for others to
        #: end before it is refused: a data party that reconnects right after
        #: its last session (train, then eval) must not find it still open
        self.settle_s = settle_s
        self._lock = threading.Condition()
        #: B's compute, shared among the tenants by weight
        self.fair = FairShare(slots)
        self._open: list[Lease] = []
        self._steps: dict[str, collections.deque[float]] = collections.defaultdict(
            collections.deque
        )

    def open(self, tenant: Tenant, run_id: str, memory: float) -> Lease:
        """A lease for a session of ``tenant`` on ``run_id`` that holds
        ``memory`` bytes at B; QuotaError with the numbers if it may not."""
        deadline = time.monotonic() + self.settle_s
        with self._lock:
            while True:
                try:
                    return self._open_now(tenant, run_id, memory)
                except QuotaError:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise
                    self._lock.wait(left)

    def _open_now(self, tenant: Tenant, run_id: str, memory: float) -> Lease:
        mine = [s for s in self._open if s.tenant.name == tenant.name]
        if any(s.run_id == run_id for s in mine):
            raise QuotaError(
                f"run {run_id} has a session open already; one session per "
                "run at a time",
                "run",
            )
        if len(mine) >= tenant.max_sessions:
            raise QuotaError(
                f"{tenant.label} has {len(mine)} session(s) open, its "
                f"quota is {tenant.max_sessions}; try again when one ends",
                "sessions",
            )
        if len(self._open) >= self.max_sessions:
            raise QuotaError(
                f"the compute party serves {len(self._open)} session(s), its "
                f"most (--max-sessions {self.max_sessions}); try again later",
                "server_sessions",
            )
        held = sum(s.memory_bytes for s in mine)
        if held + memory > tenant.memory_bytes:
            raise QuotaError(
                f"{tenant.label}: this session needs "
                f"{format_bytes(memory)} at the compute party, its sessions "
                f"hold {format_bytes(held)} of its quota of "
                f"{format_bytes(tenant.memory_bytes)}",
                "memory",
            )
        total = self.resident_bytes + sum(s.memory_bytes for s in self._open)
        if total + memory > self.memory_bytes:
            raise QuotaError(
                f"this session needs {format_bytes(memory)} at the compute "
                f"party, which has {format_bytes(self.memory_bytes - total)} "
                f"of its {format_bytes(self.memory_bytes)} free; try again later",
                "server_memory",
            )
        lease = Lease(self, tenant, run_id, memory)
        self._open.append(lease)
        return lease

    def _grow(self, lease: Lease, need: float) -> None:
        """Raise ``lease``'s memory to ``need`` bytes if both budgets allow."""
        tenant = lease.tenant
        with self._lock:
            held = sum(
                s.memory_bytes
                for s in self._open
                if s.tenant.name == tenant.name and s is not lease
            )
            if held + need > tenant.memory_bytes:
                raise QuotaError(
                    f"{tenant.label}: this round needs {format_bytes(need)} at "
                    f"the compute party, its other sessions hold "
                    f"{format_bytes(held)} of its quota of "
                    f"{format_bytes(tenant.memory_bytes)}",
                    "memory",
                )
            others = self.resident_bytes + sum(
                s.memory_bytes for s in self._open if s is not lease
            )
            if others + need > self.memory_bytes:
                raise QuotaError(
                    f"this round needs {format_bytes(need)} at the compute "
                    f"party, which has {format_bytes(self.memory_bytes - others)} "
                    f"of its {format_bytes(self.memory_bytes)} free",
                    "server_memory",
                )
            grown = need - lease.memory_bytes
            lease.memory_bytes = need
        if lease.on_grow is not None:
            lease.on_grow(grown)

    def _close(self, lease: Lease) -> None:
        with self._lock:
            self._open = [s for s in self._open if s is not lease]
            self._lock.notify_all()

    def _step(self, tenant: Tenant) -> None:
        if tenant.steps_per_hour is None:
            return
        with self._lock:
            now = self._clock()
            steps = self._steps[tenant.name]
            while steps and now - steps[0] >= HOUR_S:
                steps.popleft()
            if len(steps) >= tenant.steps_per_hour:
                wait = HOUR_S - (now - steps[0])
                raise QuotaError(
                    f"{tenant.label} trained {len(steps)} steps in the "
                    f"last hour, its quota is {tenant.steps_per_hour}; the next "
                    f"step is possible in {math.ceil(wait)} s",
                    "steps_per_hour",
                )
            steps.append(now)

    def sessions(self) -> list[tuple[str, str, float]]:
        """(tenant, run id, memory) of each open session (for logs and tests)."""
        with self._lock:
            return [(s.tenant.name, s.run_id, s.memory_bytes) for s in self._open]
