"""Tensors <-> Flower ``ArrayRecord``s, and the checks every received update passes.

Flower serialises each ``Array`` with ``np.save(allow_pickle=False)`` and we
only read them back through ``Array.numpy()`` (``np.load(allow_pickle=False)``),
so nothing that crosses a process is ever unpickled. NumPy has no bfloat16, so
bf16 tensors cannot go in an ``ArrayRecord``: everything travels as float32
(the CPU default here; on GPU the bf16 autocast keeps fp32 master weights
anyway).

An update is accepted only if it carries exactly the expected tensor names,
each with the expected shape and dtype (both the declared metadata and the
decoded array), all values finite, and a sample count that is a whole number
>= 1. The server cannot check that count, so it weighs it at most a
declared cap and a bound relative to the round's other reports
(``counted_examples``, ``round_examples_bound``); the magnitude of the update
itself is checked against the round's other updates by
``aisyn.fl.guard.UpdateGuard``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord

from aisyn.validate import name_differences

WIRE_DTYPE = "float32"
WEIGHT_KEY = "num-examples"  # Flower strategies weight by this metric
# Metrics every client reply carries (Flower requires the same keys everywhere).
REPLY_METRICS = (
    WEIGHT_KEY,
    "train-loss",
    "global-valid-loss",
    "train-s",
    "startup-s",
    "load-s",
)


class UpdateRejected(ValueError):
    """A model update failed validation; the message says which check."""


#: SCAFFOLD's ArrayRecord beside the model (``fl.scaffold``): its control
#: variate, ``c`` to the clients and ``delta c_i`` back
CONTROL = "control"


def tensors_to_record(tensors: dict[str, torch.Tensor]) -> ArrayRecord:
    """Named tensors as an ``ArrayRecord`` of float32 arrays (bf16 converted)."""
    return ArrayRecord(
        {
            name: Array(t.detach().to("cpu", torch.float32).contiguous().numpy())
            for name, t in tensors.items()
        }
    )


def payload_bytes(record: ArrayRecord) -> int:
    """Serialised size of the arrays (what travels, before HTTP framing)."""
    return sum(len(a.data) for a in record.values())


def expected_spec(record: ArrayRecord) -> dict[str, tuple[int, ...]]:
    return {k: tuple(a.shape) for k, a in record.items()}


def decode_checked(
    record: ArrayRecord, expected: dict[str, tuple[int, ...]]
) -> dict[str, np.ndarray]:
    """Decode every array, checking names, shapes, dtype and finiteness."""
    if diff := name_differences(expected, record.keys(), more=True):
        raise UpdateRejected(f"tensor names differ ({diff})")
    out = {}
    for name, arr in record.items():
        if arr.dtype != WIRE_DTYPE or tuple(arr.shape) != expected[name]:
            raise UpdateRejected(
                f"{name}: {arr.dtype}{list(arr.shape)}, expected "
                f"{WIRE_DTYPE}{list(expected[name])}"
            )
        try:
            value = arr.numpy()
        except (ValueError, TypeError, OSError) as e:
            raise UpdateRejected(f"{name}: undecodable array ({e})") from None
        if value.dtype != np.float32 or value.shape != expected[name]:
            raise UpdateRejected(
                f"{name}: payload is {value.dtype}{list(value.shape)}, its header "
                f"says {arr.dtype}{list(arr.shape)}"
            )
        if not np.isfinite(value).all():
            raise UpdateRejected(f"{name}: non-finite values")
        out[name] = value
    return out


def record_to_tensors(
    record: ArrayRecord, expected: dict[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in decode_checked(record, expected).items()}


#: no report counts more (the largest count float64 weights hold exactly;
#: two reports of 1e308 used to overflow the sum of weights to inf)
MAX_COUNTED = 2**53


def counted_examples(value: float, bound: int | None = None) -> int:
    """The weight the server gives a reported ``num-examples``: a whole number
    >= 1 (else ``UpdateRejected``), counted as at most ``bound`` (a declared
    cap, max-examples) and ``MAX_COUNTED``.

    Over the bound is clamped, not rejected: the server cannot tell a liar from
    an organisation that declared a cap too low, and a liar gains nothing by
    claiming more than the bound.
    """
    if isinstance(value, list) or not math.isfinite(float(value)):
        raise UpdateRejected(f"{WEIGHT_KEY} is not a finite number")
    if isinstance(value, float) and not value.is_integer():
        raise UpdateRejected(f"{WEIGHT_KEY} must be a whole number, got {value}")
    if value < 1:
        raise UpdateRejected(f"{WEIGHT_KEY} must be positive, got {value}")
    return min(int(value), bound or MAX_COUNTED, MAX_COUNTED)


def round_examples_bound(counts: list[int], ratio: float) -> int | None:
    """The most one report of a round counts: ``ratio`` x the round's lower
    median report (None: no bound, ratio 0 or nothing reported).

    Relative to the round, so honest clients of different sizes keep their
    FedAvg weights (a fixed cap flattened every client above it), while a liar
    gains at most ``ratio`` median clients' worth. The lower median, so that
    with two clients it is the smaller report (a liar cannot raise it).
    """
    if not ratio or not counts:
        return None
    median = sorted(counts)[(len(counts) - 1) // 2]
    return max(1, int(ratio * median))


def check_reply(
    message: Message,
    expected: dict[str, tuple[int, ...]],
    records: tuple[str, ...] = ("arrays",),
) -> dict[str, np.ndarray]:
    """The decoded arrays of ``message``; ``UpdateRejected`` unless it is a
    well-formed, sane update (its sample count is checked by ``counted_examples``)
    carrying exactly the ArrayRecords ``records``, each of the model's tensors
    (SCAFFOLD's replies add their control variate's)."""
    check_metrics(message)
    content = message.content
    if set(content.array_records) != set(records):
        names = " and ".join(repr(r) for r in records)
        raise UpdateRejected(f"expected exactly the ArrayRecords {names}")
    for name in records[1:]:
        decode_checked(content.array_records[name], expected)
    return decode_checked(content.array_records[records[0]], expected)


def check_metrics(message: Message) -> None:
    """``UpdateRejected`` unless ``message`` is a reply with exactly the metrics
    every train reply carries, each a finite number (a chunked round's train
    reply carries nothing else: its update comes in chunks)."""
    if message.has_error():
        raise UpdateRejected(f"client failed: {message.error.reason}")
    content = message.content
    if len(content.metric_records) != 1 or "metrics" not in content.metric_records:
        raise UpdateRejected("expected exactly one MetricRecord named 'metrics'")
    metrics: MetricRecord = content.metric_records["metrics"]
    if set(metrics.keys()) != set(REPLY_METRICS):
        raise UpdateRejected(
            f"metrics {sorted(metrics.keys())} != {list(REPLY_METRICS)}"
        )
    for key in REPLY_METRICS:
        value = metrics[key]
        if isinstance(value, list) or not math.isfinite(float(value)):
            raise UpdateRejected(f"metric {key!r} is not a finite number")
