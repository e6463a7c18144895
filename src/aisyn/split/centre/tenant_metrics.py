"""What each tenant of a compute centre uses, for the operator.

Live, on a Prometheus endpoint (``aisyn split serve --metrics-listen
HOST:PORT``, over mutual TLS with ``--metrics-tls-*``:
``split.centre.metrics_endpoint``; ``aisyn split status --metrics HOST:PORT`` reads
it back as a table): per tenant, the steps and tokens trained, the compute
seconds B spent on them, the bytes each way, the sessions open and the memory they
hold, the time sessions waited to be admitted, and the refusals by quota.
And per session, one JSON line in the tenant's folder
(``OUT/<tenant>/_sessions.jsonl``) when it ends.

The registry is this server's own (not the process-wide default), so two
servers in one process -- tests -- count apart.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families

from aisyn.split.centre.metrics_endpoint import MetricsTls, serve_metrics

log = logging.getLogger(__name__)

PREFIX = "aisyn_tenant_"
#: a tenant's session records, beside its runs (no run id starts with "_")
SESSIONS_FILE = "_sessions.jsonl"
#: the per-tenant figures ``aisyn split status`` shows, in its order
COLUMNS = (
    ("sessions", "sessions"),
    ("steps_total", "steps"),
    ("tokens_total", "tokens"),
    ("compute_seconds_total", "compute s"),
    ("received_bytes_total", "bytes in"),
    ("sent_bytes_total", "bytes out"),
    ("memory_bytes", "memory"),
    ("queue_wait_seconds_total", "queued s"),
    ("refusals_total", "refused"),
)


@dataclass
class SessionRecord:
    """One session's line in its tenant's ``_sessions.jsonl``."""

    tenant: str
    run_id: str
    purpose: str
    started: float  # unix time
    queue_wait_s: float
    memory_bytes: float
    steps: int = 0
    tokens: int = 0
    compute_s: float = 0.0
    received_bytes: int = 0
    sent_bytes: int = 0
    ended: float = 0.0
    outcome: str = ""


class TenantMetrics:
    """The centre's counters, labelled by tenant."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def counter(name: str, text: str, labels=("tenant",)) -> Counter:
            return Counter(PREFIX + name, text, labels, registry=r)

        def gauge(name: str, text: str) -> Gauge:
            return Gauge(PREFIX + name, text, ("tenant",), registry=r)

        self.steps = counter("steps", "training steps B ran for the tenant")
        self.tokens = counter("tokens", "tokens of those steps")
        self.compute = counter("compute_seconds", "B's CPU seconds on its rounds")
        self.received = counter("received_bytes", "bytes B received from it")
        self.sent = counter("sent_bytes", "bytes B sent to it")
        self.queue_wait = counter(
            "queue_wait_seconds", "seconds its sessions waited to be admitted"
        )
        self.refusals = counter(
            "refusals", "sessions or steps refused by a quota", ("tenant", "quota")
        )
        self.sessions = gauge("sessions", "sessions open now")
        self.memory = gauge("memory_bytes", "what its open sessions hold at B")
        self._server = None
        self._lock = threading.Lock()

    def serve(self, address: str, tls: MetricsTls | None = None) -> int:
        """Expose the registry on ``address`` ("host:port"), over mutual TLS
        with ``tls``; the bound port."""
        from aisyn.net import split_host_port

        host, port = split_host_port(address)
        self._server, bound = serve_metrics(self.registry, host, port, tls)
        return bound

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # -- what the server reports

    def opened(self, record: SessionRecord) -> None:
        t = record.tenant
        self.sessions.labels(t).inc()
        self.memory.labels(t).inc(record.memory_bytes)
        self.queue_wait.labels(t).inc(record.queue_wait_s)

    def grew(self, record: SessionRecord, grown: float) -> None:
        """A session's memory grew to fit a larger round."""
        with self._lock:
            record.memory_bytes += grown
        self.memory.labels(record.tenant).inc(grown)

    def refused(self, tenant: str, quota: str) -> None:
        self.refusals.labels(tenant, quota).inc()

    def round(
        self,
        record: SessionRecord,
        *,
        steps: int,
        tokens: int,
        compute_s: float,
        received: int,
        sent: int,
    ) -> None:
        """One round of ``record``'s session (the deltas it added)."""
        t = record.tenant
        with self._lock:
            record.steps += steps
            record.tokens += tokens
            record.compute_s += compute_s
            record.received_bytes += received
            record.sent_bytes += sent
        self.steps.labels(t).inc(steps)
        self.tokens.labels(t).inc(tokens)
        self.compute.labels(t).inc(compute_s)
        self.received.labels(t).inc(received)
        self.sent.labels(t).inc(sent)

    def closed(self, record: SessionRecord, folder: Path | None, outcome: str) -> None:
        """The session ended: its line written, then its gauges back down (a
        status that shows it gone finds its line there)."""
        t = record.tenant
        record.ended, record.outcome = time.time(), outcome
        if folder is not None:
            try:
                folder.mkdir(parents=True, exist_ok=True)
                with (folder / SESSIONS_FILE).open("a", encoding="utf-8") as f:
                    f.write(json.dumps(asdict(record)) + "\n")
            except OSError as e:  # the session's work is saved; only the line is lost
                log.error("could not record the session in %s: %s", folder, e)
        self.sessions.labels(t).dec()
        self.memory.labels(t).dec(record.memory_bytes)


def read_status(text: str) -> dict[str, dict[str, float]]:
    """Per-tenant figures from a metrics page (``COLUMNS``' keys)."""
    out: dict[str, dict[str, float]] = {}
    names = {PREFIX + key.removesuffix("_total"): key for key, _ in COLUMNS}
    for family in text_string_to_metric_families(text):
        key = names.get(family.name)
        if key is None:
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            tenant = sample.labels.get("tenant")
            if tenant is None:
                continue
            row = out.setdefault(tenant, {})
            row[key] = row.get(key, 0.0) + sample.value
    return out


def format_status(rows: dict[str, dict[str, float]]) -> str:
    """``aisyn split status``'s table."""
    from aisyn.model.cost import format_bytes

    head = ["tenant", *(label for _, label in COLUMNS)]
    lines = [head]
    for tenant in sorted(rows):
        row = rows[tenant]
        cells = [tenant]
        for key, _ in COLUMNS:
            v = row.get(key, 0.0)
            if "bytes" in key:
                cells.append(format_bytes(v))
            elif "seconds" in key:
                cells.append(f"{v:.1f}")
            else:
                cells.append(f"{v:,.0f}")
        lines.append(cells)
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        padded = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(padded)

    return "\n".join(line(r) for r in lines)
