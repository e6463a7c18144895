"""Chunked transfer: a model in several Flower messages, each under a size limit.

With ``max-message-mb`` set and a model whose trainable tensors exceed it (a
2.6B fp32 update is 10.4 GB, beyond gRPC's and protobuf's 2 GB), the global
model and every update travel in **chunks**: groups of named tensors in a
fixed order (sorted names), a tensor larger than the limit split along its
first dimension into row ranges. ``plan_chunks`` computes the plan from the
names, shapes and limit alone, so both sides compute the same one and nothing
about it has to be believed from the wire. A chunk is one ``ArrayRecord``
whose keys are its pieces (``name`` for a whole tensor, ``name[a:b]`` for rows
a..b-1 of one) and a ``ConfigRecord`` ``chunk`` saying round, index and count.

The exchange of a round (``fl.chunked_grid.ChunkedGrid`` on the server, the
``query`` handlers of ``client_app`` on the client):

1. the server sends the global model chunk by chunk to every sampled node
   (``query.global_chunk``); each client checks and stages it as a safetensors
   file in a private folder of its run folder (one process per message);
2. the train message carries only the config and ``chunk-count``: the client
   assembles the global model from its staged chunks (all present, each
   exactly the plan's pieces), trains, and writes its update to that folder;
3. the server pulls the update chunk by chunk (``query.update_chunk``), checks
   each (``ChunkReceiver``: round, index, not repeated, the plan's names and
   shapes, float32, finite, under the limit), adds the node's squared distance
   to the global model and spills it to a safetensors file of its own, so it
   never holds every client's whole update at once;
4. ``UpdateGuard`` then aggregates chunk by chunk, with Flower's own
   strategy on each chunk's records (FedAvg's weighted mean, the trimmed mean
   and the median are coordinate-wise, so the result is the unchunked one's,
   bit for bit), after the same weight and norm bounds as unchunked rounds.

A node whose update misses a chunk, repeats one, mixes rounds, names a tensor
or shape not in the plan, or sends non-finite values is rejected for the
round with one line naming the problem; the others' aggregate is unaffected.

What it cannot do (refused by ``chunked_problem``): SecAgg+ and client DP act
on one whole message; Krum, MultiKrum and Bulyan compare whole updates;
FedAdam's and FedAvgM's server optimiser state is one whole model. The server
still holds the global model (one copy, and its float64 copy for the norms).
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from aisyn.fl.records import WIRE_DTYPE, UpdateRejected, decode_checked, payload_bytes
from aisyn.train import checkpoint as ckpt

log = logging.getLogger("aisyn.fl.chunks")

MiB = 2**20
#: a float32 array's npy header (what ``payload_bytes`` counts beside its data)
NPY_HEADER = 128
#: room left in each message for its keys and Flower's framing
MESSAGE_SLACK = 2048
#: the smallest limit that leaves room for a row of a small tensor
MIN_LIMIT = 4096
GLOBAL_CHUNK = "query.global_chunk"
UPDATE_CHUNK = "query.update_chunk"
CHUNK_META = "chunk"
COUNT_KEY = "chunk-count"  # in a chunked round's train / evaluate config
STAGING = ".fl-chunks"  # a client's private folder in its run folder
UPDATE_FILE = "update.safetensors"
_PIECE = re.compile(r"^(?P<name>.+)\[(?P<a>\d+):(?P<b>\d+)\]$")


@dataclass(frozen=True)
class Piece:
    """Rows ``start:stop`` of tensor ``name`` along its first dimension (the
    whole tensor when ``start`` is None)."""

    name: str
    start: int | None = None
    stop: int | None = None

    @property
    def key(self) -> str:
        return (
            self.name
            if self.start is None
            else f"{self.name}[{self.start}:{self.stop}]"
        )

    def shape(self, spec: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
        full = tuple(spec[self.name])
        return full if self.start is None else (self.stop - self.start, *full[1:])

    def take(self, array):
        return array if self.start is None else array[self.start : self.stop]


Plan = list[list[Piece]]


def limit_bytes(max_message_mb: float) -> int:
    return int(max_message_mb * MiB)


def plan_chunks(spec: dict[str, tuple[int, ...]], limit: int) -> Plan:
    """Chunks of at most ``limit`` bytes as ``payload_bytes`` counts them (data
    and npy headers; ``MESSAGE_SLACK`` left for the rest), tensors in sorted
    name order; ValueError when a single row cannot fit."""
    budget = limit - MESSAGE_SLACK
    if limit < MIN_LIMIT:
        raise ValueError(f"message limit {limit} bytes is under {MIN_LIMIT}")
    plan: Plan = []
    current: list[Piece] = []
    used = 0
    for name in sorted(spec):
        shape = tuple(spec[name])
        data = 4 * math.prod(shape)  # float32 on the wire
        if used + data + NPY_HEADER > budget and current:
            plan.append(current)
            current, used = [], 0
        if data + NPY_HEADER <= budget:
            current.append(Piece(name))
            used += data + NPY_HEADER
            continue
        row = data // shape[0] if shape and shape[0] else data
        if not shape or row + NPY_HEADER > budget:
            raise ValueError(
                f"{name}: one row along its first dimension is {row} bytes, more "
                f"than a {limit}-byte message holds; raise max-message-mb"
            )
        per = (budget - NPY_HEADER) // row
        for start in range(0, shape[0], per):
            stop = min(shape[0], start + per)
            piece = Piece(name, start, stop)
            if stop - start == per:
                plan.append([piece])
            else:  # the tail shares a chunk with what follows
                current, used = [piece], row * (stop - start) + NPY_HEADER
    if current:
        plan.append(current)
    return plan


def chunk_spec(spec: dict[str, tuple[int, ...]], chunk: list[Piece]) -> dict:
    return {p.key: p.shape(spec) for p in chunk}


def chunk_arrays(arrays: dict[str, np.ndarray], chunk: list[Piece]) -> ArrayRecord:
    """The chunk's pieces of ``arrays`` (whole tensors by name), float32."""
    return ArrayRecord(
        {
            p.key: Array(np.ascontiguousarray(p.take(arrays[p.name]), np.float32))
            for p in chunk
        }
    )


def chunk_meta(server_round: int, index: int, count: int, limit: int) -> ConfigRecord:
    return ConfigRecord(
        {"round": server_round, "index": index, "count": count, "limit": limit}
    )


def read_meta(content: RecordDict) -> tuple[int, int, int]:
    """(round, index, count) of a chunk message; UpdateRejected if malformed."""
    meta = content.config_records.get(CHUNK_META)
    if meta is None:
        raise UpdateRejected("no chunk record")
    try:
        values = tuple(meta[k] for k in ("round", "index", "count"))
    except KeyError as e:
        raise UpdateRejected(f"chunk record lacks {e}") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise UpdateRejected(f"chunk record {dict(meta)} is not whole numbers")
    return values  # type: ignore[return-value]


class ChunkReceiver:
    """Checks one sender's chunks of one round against the plan.

    ``accept`` returns a chunk's index and decoded arrays (keyed by piece), or
    raises ``UpdateRejected`` naming what is wrong; ``check_complete`` raises
    when a chunk is missing."""

    def __init__(
        self,
        spec: dict[str, tuple[int, ...]],
        plan: Plan,
        server_round: int,
        limit: int,
    ) -> None:
        self.spec, self.plan, self.round, self.limit = spec, plan, server_round, limit
        self.seen: set[int] = set()

    def accept(self, content: RecordDict) -> tuple[int, dict[str, np.ndarray]]:
        r, index, count = read_meta(content)
        if r != self.round:
            raise UpdateRejected(f"a chunk of round {r} in round {self.round}")
        if count != len(self.plan):
            raise UpdateRejected(
                f"chunk says {count} chunks, the model's plan has {len(self.plan)}"
            )
        if not 0 <= index < count:
            raise UpdateRejected(f"chunk index {index} not in 0..{count - 1}")
        if index in self.seen:
            raise UpdateRejected(f"chunk {index} repeated")
        records = content.array_records
        if list(records) != ["arrays"]:
            raise UpdateRejected(f"chunk {index}: expected one ArrayRecord 'arrays'")
        record = records["arrays"]
        size = payload_bytes(record)
        if size > self.limit:
            raise UpdateRejected(
                f"chunk {index}: {size} bytes, over the {self.limit}-byte limit"
            )
        try:
            arrays = decode_checked(record, chunk_spec(self.spec, self.plan[index]))
        except UpdateRejected as e:
            raise UpdateRejected(f"chunk {index}: {e}") from None
        self.seen.add(index)
        return index, arrays

    def missing(self) -> list[int]:
        return [i for i in range(len(self.plan)) if i not in self.seen]

    def check_complete(self) -> None:
        if missing := self.missing():
            raise UpdateRejected(
                f"missing chunk(s) {missing[:5]}{'...' if len(missing) > 5 else ''}"
                f" of {len(self.plan)}"
            )


def assemble(
    spec: dict[str, tuple[int, ...]], plan: Plan, chunks: Iterable[dict]
) -> dict[str, np.ndarray]:
    """Whole float32 tensors from the plan's chunks (dicts by piece key), in
    plan order."""
    out = {n: np.empty(tuple(s), np.float32) for n, s in spec.items()}
    for chunk, arrays in zip(plan, chunks, strict=True):
        for p in chunk:
            if p.start is None:
                out[p.name][...] = arrays[p.key]
            else:
                out[p.name][p.start : p.stop] = arrays[p.key]
    return out


def chunked_problem(settings) -> str | None:
    """Why ``settings`` cannot run with chunked updates, or None."""
    if settings.secure_aggregation:
        return "secure aggregation masks one whole message per client"
    if settings.dp != "off":
        return "client DP clips and noises each whole update"
    if settings.aggregation in ("krum", "multikrum", "bulyan"):
        return f"aggregation {settings.aggregation} compares whole updates"
    if settings.strategy in ("fedadam", "fedavgm"):
        return (
            f"strategy {settings.strategy}'s server optimiser state is one whole model"
        )
    return None


def plan_for(settings, spec: dict[str, tuple[int, ...]]) -> Plan | None:
    """The chunk plan of a run, None when its model fits one message (or no
    limit is set); ValueError for what cannot run chunked."""
    if not settings.max_message_mb:
        return None
    limit = limit_bytes(settings.max_message_mb)
    plan = plan_chunks(spec, limit)
    if len(plan) == 1:
        return None
    if problem := chunked_problem(settings):
        raise ValueError(
            f"the trainable tensors need {len(plan)} messages of max-message-mb "
            f"{settings.max_message_mb:g}, but {problem}: raise max-message-mb or "
            "drop it"
        )
    return plan


# --- client side ------------------------------------------------------------------


def save_arrays(path: Path, arrays: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(tmp))
    os.replace(tmp, path)


def load_arrays(path: Path) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in ckpt.read_tensors(path).items()}


def staging_dir(out: Path, run_id: int, server_round: int) -> Path:
    return Path(out) / STAGING / f"run{run_id}-round{server_round}"


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.parent.chmod(0o700)
    return path


def stage_global(out: Path, run_id: int, content: RecordDict) -> int:
    """Check and stage one chunk of the global model; returns its index. The
    first chunk of a round clears every other round's staging."""
    r, index, count = read_meta(content)
    if not 0 <= index < count or r < 1:
        raise ValueError(f"global chunk {index} of {count} in round {r}")
    record = content.array_records.get("arrays")
    if record is None:
        raise ValueError(f"global chunk {index}: no arrays")
    folder = staging_dir(out, run_id, r)
    if index == 0 and (Path(out) / STAGING).is_dir():
        for other in (Path(out) / STAGING).iterdir():
            if other != folder:
                shutil.rmtree(other, ignore_errors=True)
    _private_dir(folder)
    path = folder / f"global-{index}.safetensors"
    if path.exists():
        raise ValueError(f"global chunk {index} of round {r} repeated")
    arrays = {}
    for key, arr in record.items():
        if arr.dtype != WIRE_DTYPE:
            raise ValueError(f"global chunk {index}: {key} is {arr.dtype}")
        value = arr.numpy()  # np.load(allow_pickle=False)
        if not np.isfinite(value).all():
            raise ValueError(f"global chunk {index}: {key}: non-finite values")
        arrays[key] = value
    save_arrays(path, arrays)
    return index


def load_staged_global(
    out: Path,
    run_id: int,
    server_round: int,
    spec: dict[str, tuple[int, ...]],
    plan: Plan,
    count: int,
) -> dict[str, np.ndarray]:
    """The global model from the round's staged chunks, each checked against
    this client's plan (``ValueError`` naming the first problem)."""
    if count != len(plan):
        raise ValueError(
            f"server sends {count} chunks, this model's plan has {len(plan)}"
        )
    folder = staging_dir(out, run_id, server_round)
    chunks = []
    for i, chunk in enumerate(plan):
        path = folder / f"global-{i}.safetensors"
        if not path.is_file():
            raise ValueError(f"global chunk {i} of {count} never arrived")
        arrays = load_arrays(path)
        expected = chunk_spec(spec, chunk)
        got = {k: tuple(v.shape) for k, v in arrays.items()}
        if got != expected:
            raise ValueError(f"global chunk {i}: {got} is not the plan's {expected}")
        chunks.append(arrays)
        path.unlink()
    return assemble(spec, plan, chunks)


def save_update(
    out: Path, run_id: int, server_round: int, arrays: dict[str, np.ndarray]
) -> Path:
    path = _private_dir(staging_dir(out, run_id, server_round)) / UPDATE_FILE
    save_arrays(path, arrays)
    return path


def update_chunk(out: Path, run_id: int, config: ConfigRecord) -> RecordDict:
    """The requested chunk of this client's update of that round, read from its
    update file (only the chunk's rows)."""
    try:
        r, index, limit = (int(config[k]) for k in ("round", "index", "limit"))
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"malformed update-chunk request {dict(config)}") from None
    path = staging_dir(out, run_id, r) / UPDATE_FILE
    if not path.is_file():
        raise ValueError(f"no update of round {r} to send")
    with ckpt.opened(path) as f:
        spec = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        plan = plan_chunks(spec, limit)
        if not 0 <= index < len(plan):
            raise ValueError(f"update chunk {index} not in 0..{len(plan) - 1}")
        arrays = {
            p.key: (
                f.get_tensor(p.name)
                if p.start is None
                else f.get_slice(p.name)[p.start : p.stop]
            ).numpy()
            for p in plan[index]
        }
    return RecordDict(
        {
            "arrays": ArrayRecord(
                {k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()}
            ),
            CHUNK_META: chunk_meta(r, index, len(plan), limit),
        }
    )
