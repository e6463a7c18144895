"""What the two parties of a split run say to each other, on top of the link.

A session opens with a JSON *hello* from the data party A (carried in the
link's HELLO session string over gRPC, or handed over directly in-process)
and a JSON *reply* from the compute party B. The hello names the run, the
model and cut A expects B to hold, the optimisation settings B needs for its
own parameters (``COMPUTE_PARTY_TRAIN_FIELDS``: never the seed), the init
seeds of B's own parameters for a fresh run from random init, whether B
trains LoRA adapters on its frozen blocks (rank, alpha and the init seeds of
the adapters' ``A`` matrices) instead of the blocks themselves, which
checkpoints A has, and the fingerprint of the base model A starts a fresh run
from (``--init-from``; none: random init); the reply names the step both
resume from. docs/split.md#security lists all that B learns.

After that the session is a sequence of *rounds*, numbered 0, 1, 2, ... (the
link's step id). Each round starts with a control tensor from A (tag
``ctl``), int64 ``[op, step, micro_batches, micro_size, seq_len, window,
flags]``:

* ``TRAIN``: one optimizer step over ``micro_batches`` micro-batches; per
  micro-batch ``act`` (A->B, the front's output), ``out`` (B->A, the middle's
  output), ``gout`` (A->B, gradient of ``out``), ``gact`` (B->A, gradient of
  ``act``), and ``doc`` (A->B, int32 document index per position) only with
  the EOD reset; then one scalar ``sqnorm`` each way (local squared gradient
  norm) for the global clip.
* ``EVAL``: forward only, one micro-batch: ``act`` then ``out``.
* ``SAVE``: B checkpoints its segments at ``step`` and answers the scalar
  ``saved`` (= step, or -1 on failure); only then A writes its own half.

A ``generate`` session (text generation from the data party's checkpoint)
has three more, for one sequence at a time, each party keeping the KV cache
of its own layers:

* ``GEN_START``: open B's cache for ``seq_len`` positions (its capacity); no
  tensors.
* ``GEN_STEP``: the next positions ``[step, step + seq_len)`` (``step`` is the
  first position, which must be where B's cache stands): ``act`` (A->B, the
  front's output for those positions only), ``out`` (B->A, the middle's).
* ``GEN_END``: B frees the cache; no tensors.

Nothing else crosses: B never sees token ids, labels or the loss; frame
metadata carries only tags, sizes and ids.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import astuple, dataclass

import torch

from aisyn.link.codec import CODECS
from aisyn.train.config import TrainConfig
from aisyn.train.lora import Method
from aisyn.validate import name_differences

# /2: the hello carries only the settings B needs and B's own init seeds
# /3: generate sessions (purpose "generate", GEN_* rounds)
PROTOCOL = "aisyn-split/3"

TRAIN, EVAL, SAVE, GEN_START, GEN_STEP, GEN_END = 1, 2, 3, 4, 5, 6
OPS = {
    TRAIN: "TRAIN",
    EVAL: "EVAL",
    SAVE: "SAVE",
    GEN_START: "GEN_START",
    GEN_STEP: "GEN_STEP",
    GEN_END: "GEN_END",
}
GEN_OPS = (GEN_START, GEN_STEP, GEN_END)
PURPOSES = ("train", "eval", "generate")
#: what the compute party does with its blocks in a training run
BACKBONES = ("train", "frozen")
FLAG_EOD = 1

#: generous bounds a compute party accepts from a data party
MAX_MICRO_BATCHES = 4096
MAX_MICRO_SIZE = 65536
MAX_WINDOW = 64

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class ProtocolError(ValueError):
    """The peer broke the split protocol (bad hello, control or values)."""


@dataclass(frozen=True)
class Control:
    op: int
    step: int
    micro_batches: int = 0
    micro_size: int = 0
    seq_len: int = 0
    window: int = 0
    flags: int = 0

    def tensor(self) -> torch.Tensor:
        """The control on the wire: its fields in their order (``parse``)."""
        return torch.tensor(astuple(self), dtype=torch.int64)

    @property
    def eod(self) -> bool:
        return bool(self.flags & FLAG_EOD)

    @classmethod
    def parse(cls, t: torch.Tensor, max_seq_len: int) -> Control:
        """Validate a received control tensor (shape/dtype already checked)."""
        op, step, m, mb, T, window, flags = (int(v) for v in t.tolist())
        c = cls(op, step, m, mb, T, window, flags)
        if op not in OPS:
            raise ProtocolError(f"control: unknown op {op}")
        if step < 0:
            raise ProtocolError(f"control: negative step {step}")
        if flags & ~FLAG_EOD:
            raise ProtocolError(f"control: unknown flags {flags:#x}")
        if op in (TRAIN, EVAL):
            if not 1 <= m <= MAX_MICRO_BATCHES or (op == EVAL and m != 1):
                raise ProtocolError(f"control: {m} micro-batches for {OPS[op]}")
            if not 1 <= mb <= MAX_MICRO_SIZE:
                raise ProtocolError(f"control: micro-batch size {mb}")
            if not 1 <= T <= max_seq_len:
                raise ProtocolError(
                    f"control: sequence length {T} outside 1..{max_seq_len}"
                )
            if not 0 <= window <= MAX_WINDOW:
                raise ProtocolError(f"control: pipeline window {window}")
        elif op in GEN_OPS:
            # One sequence, no pipeline, no EOD reset (a cache decodes one
            # document); positions must have a learned embedding.
            name = OPS[op]
            if op == GEN_END:
                if (m, mb, T, window, flags) != (0, 0, 0, 0, 0):
                    raise ProtocolError(f"control: {name} carries no sizes")
            elif (m, mb, window, flags) != (1, 1, 0, 0):
                raise ProtocolError(
                    f"control: {name} is one sequence of one micro-batch, no "
                    "pipeline window or flags"
                )
            elif op == GEN_START and not 1 <= T <= max_seq_len:
                raise ProtocolError(
                    f"control: KV cache capacity {T} outside 1..{max_seq_len}"
                )
            elif op == GEN_STEP and not (T >= 1 and step + T <= max_seq_len):
                raise ProtocolError(
                    f"control: positions [{step}, {step + T}) outside "
                    f"0..{max_seq_len - 1} (or none)"
                )
        return c

    @classmethod
    def gen_start(cls, capacity: int) -> Control:
        return cls(GEN_START, 0, 1, 1, capacity)

    @classmethod
    def gen_step(cls, first_position: int, count: int) -> Control:
        return cls(GEN_STEP, first_position, 1, 1, count)

    @classmethod
    def gen_end(cls) -> Control:
        return cls(GEN_END, 0)


def check_run_id(run_id: object) -> str:
    """A run id names a folder on the compute party: keep it a plain name."""
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise ProtocolError(
            f"run id {run_id!r} must be 1-64 characters of letters, digits, . _ -"
        )
    return run_id


def encode_json(obj: dict) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def decode_json(text: str, what: str) -> dict:
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ProtocolError(f"{what}: not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what}: must be a JSON object")
    if obj.get("protocol") != PROTOCOL:
        raise ProtocolError(
            f"{what}: protocol {obj.get('protocol')!r}, this side speaks {PROTOCOL!r}"
        )
    return obj


#: The training settings the compute party needs to step its own parameters
#: (AdamW's learning-rate schedule and weight decay, and the clip threshold of
#: the global norm) and to compute its blocks as the unsplit run would (the
#: autocast mode, whether blocks recompute their activations), and nothing
#: else: not the seed (from which the data party's initial weights follow),
#: the batch size, the data or the device.
COMPUTE_PARTY_TRAIN_FIELDS = (
    "steps",
    "lr",
    "min_lr",
    "warmup_steps",
    "weight_decay",
    "grad_clip",
    "autocast",
    "activation_checkpointing",
)
#: the fields of those that are not numbers, and what they are
_NON_NUMERIC = {
    "autocast": (str, "a string"),
    "activation_checkpointing": (bool, "true or false"),
}
_MAX_SEED = 2**63


def compute_party_train(train: TrainConfig) -> dict:
    """What of ``train`` the hello carries (``COMPUTE_PARTY_TRAIN_FIELDS``)."""
    d = train.to_dict()
    return {k: d[k] for k in COMPUTE_PARTY_TRAIN_FIELDS}


def parse_compute_party_train(d: object) -> TrainConfig:
    """The compute party's ``TrainConfig`` from a hello's ``train`` object;
    any other field is refused, so that nothing more is ever sent by mistake."""
    if not isinstance(d, dict):
        raise ProtocolError("hello: no training settings")
    if diff := name_differences(COMPUTE_PARTY_TRAIN_FIELDS, d, more=True):
        raise ProtocolError(
            f"hello: training settings must be exactly "
            f"{list(COMPUTE_PARTY_TRAIN_FIELDS)} ({diff})"
        )
    for k, v in d.items():
        if k in _NON_NUMERIC:
            kind, shown = _NON_NUMERIC[k]
            if not isinstance(v, kind):
                raise ProtocolError(f"hello: training setting {k} must be {shown}")
            continue
        ok = isinstance(v, int | float) and not isinstance(v, bool)
        if not ok and not (k == "min_lr" and v is None):
            raise ProtocolError(f"hello: training setting {k} must be a number")
    try:
        return TrainConfig(**d)  # range checks
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"hello: bad training settings ({e})") from None


def parse_init_seeds(seeds: object, names: list[str]) -> dict[str, int] | None:
    """A hello's per-parameter init seeds: exactly ``names``, each an integer in
    [0, 2**63); None if the hello carries none."""
    if seeds is None:
        return None
    if not isinstance(seeds, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < _MAX_SEED
        for v in seeds.values()
    ):
        raise ProtocolError("hello: init_seeds must map names to integers < 2**63")
    if diff := name_differences(names, seeds):
        raise ProtocolError(
            f"hello: init_seeds are not this party's parameters ({diff})"
        )
    return dict(seeds)


def parse_lora(d: object, names_for) -> tuple[Method, dict[str, int]] | None:
    """A hello's ``lora`` object: (method, seeds) or None for full training.
    ``names_for(method)`` lists the ``A`` matrices the seeds must name."""
    if d is None:
        return None
    if not isinstance(d, dict) or set(d) != {"rank", "alpha", "seeds"}:
        raise ProtocolError("hello: lora must be an object of rank, alpha, seeds")
    rank, alpha = d["rank"], d["alpha"]
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= 4096:
        raise ProtocolError(f"hello: lora rank must be in 1..4096, got {rank!r}")
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, int | float)
        or not math.isfinite(alpha)
        or alpha <= 0
    ):
        raise ProtocolError(f"hello: lora alpha must be a number > 0, got {alpha!r}")
    method = Method("lora", rank=rank, alpha=float(alpha))
    seeds = parse_init_seeds(d["seeds"], names_for(method))
    if seeds is None:
        raise ProtocolError("hello: lora needs the seeds of its A matrices")
    return method, seeds


def hello(
    *,
    purpose: str,
    run_id: str,
    model: dict,
    partition: dict,
    train: TrainConfig,
    init_seeds: dict[str, int] | None = None,
    lora: dict | None = None,
    resume: bool = False,
    a_steps: list[int] | None = None,
    eval_step: int | None = None,
    codec: str = "none",
    init: str | None = None,
    backbone: str = "train",
) -> dict:
    """The data party's hello: everything the compute party is told about
    the run (docs/split.md#security lists it). ``backbone`` "frozen": the
    compute party runs its blocks forward only for the whole run, from the
    base, and no gradient crosses the cut. ``init_seeds``: per-parameter
    seeds of the compute party's own parameters, for a fresh run from random
    init; the run's seed itself never leaves the data party. ``eval_step``:
    the checkpoint an ``eval`` or ``generate`` session runs from."""
    return {
        "protocol": PROTOCOL,
        "purpose": purpose,
        "run_id": run_id,
        "model": model,
        "partition": partition,
        "train": compute_party_train(train),
        "init_seeds": init_seeds,
        "lora": lora,
        "resume": resume,
        "a_steps": sorted(a_steps or []),
        "eval_step": eval_step,
        "codec": codec,
        "init": init,  # fingerprint of the base a fresh run starts from
        "backbone": backbone,
    }


@dataclass(frozen=True)
class Hello:
    """A data party's hello, each field checked as far as it can be without
    the compute party (``parse_hello``). What only the compute party can
    judge, against its own model, cut, base and checkpoints, it judges in
    ``ComputeParty.negotiate``, the names of the seeds with ``parse_init_seeds``
    and ``parse_lora`` once it knows the cut is its own."""

    purpose: str
    run_id: str
    model: object  # as sent: the compute party names how it differs from its own
    partition: object  # likewise
    train: TrainConfig
    init_seeds: object  # as sent, for parse_init_seeds
    lora: object  # as sent, for parse_lora
    resume: bool
    a_steps: list[int]
    eval_step: object  # as sent: it must be one of the compute party's checkpoints
    codec: str
    init: str | None  # fingerprint of the base a fresh run starts from
    backbone: str = "train"  # or "frozen": forward only, no gradient crosses


def parse_hello(text: str) -> Hello:
    """The data party's hello, checked field by field (see ``Hello``)."""
    h = decode_json(text, "hello")
    run_id = check_run_id(h.get("run_id"))
    purpose = h.get("purpose")
    if purpose not in PURPOSES:
        raise ProtocolError(f"hello: unknown purpose {purpose!r}")
    train = parse_compute_party_train(h.get("train"))
    codec = h.get("codec", "none")
    if codec not in CODECS:
        raise ProtocolError(f"hello: unknown codec {codec!r}")
    a_steps = h.get("a_steps")
    if not isinstance(a_steps, list) or not all(map(_is_step, a_steps)):
        raise ProtocolError("hello: a_steps must be a list of steps")
    init = h.get("init")
    if init is not None and not (
        isinstance(init, str) and re.fullmatch(r"[0-9a-f]{64}", init)
    ):
        raise ProtocolError("hello: init must be a sha256 hex digest")
    backbone = h.get("backbone", "train")  # a data party from before it: train
    if backbone not in BACKBONES:
        raise ProtocolError(f"hello: unknown backbone {str(backbone)[:20]!r}")
    return Hello(
        purpose,
        run_id,
        h.get("model"),
        h.get("partition"),
        train,
        h.get("init_seeds"),
        h.get("lora"),
        bool(h.get("resume")),
        a_steps,
        h.get("eval_step"),
        codec,
        init,
        backbone,
    )


def reply(start_step: int, b_steps: list[int]) -> dict:
    return {"protocol": PROTOCOL, "start_step": start_step, "b_steps": b_steps}


def parse_reply(text: str) -> dict:
    """The compute party's reply, checked before the data party acts on it."""
    r = decode_json(text, "compute party's reply")
    start, b_steps = r.get("start_step"), r.get("b_steps")
    if not _is_step(start):
        raise ProtocolError(
            f"compute party's reply: start_step {repr(start)[:40]} is not a step "
            "(an integer >= 0)"
        )
    if not isinstance(b_steps, list) or not all(map(_is_step, b_steps)):
        raise ProtocolError(
            "compute party's reply: b_steps must be a list of steps (integers >= 0)"
        )
    return r


def _is_step(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
