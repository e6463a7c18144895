"""The cost of a model's pieces, from its shape alone: FLOPs, bytes, and the
parameters each module and each FSDP2 shard of it holds.

Parameter counts come from the model built on the meta device (so they are the
model's own, for any preset up to 200B, without allocating a byte); FLOPs and
activation bytes from the standard transformer formulas below. Nothing here
runs the model. ``model.memory`` adds these up per rank of a party;
``split.planner`` weighs the cuts with it.

Per token, forward, for hidden size h, FFN size f, vocabulary V, sequence T:

* ordinary block: ``2 * (4h² + 2hf)`` matmul FLOPs + ``4Th`` for attention
  (scores and weighted sum, full T x T as CPU SDPA computes it);
* top query layer: the same as a block;
* tied head: ``2hV``; embeddings: lookups, counted as 0.

Training is 3x forward (backward = 2x forward).

Activations are the tensors autograd saves, counted for the PanGu-α block
(``block_activation_bytes``, checked against ``saved_tensors_hooks`` in the
tests): eight (B, T, h) and two (B, T, f) tensors per block, the fused
attention kernel keeping no T x T scores; other families keep the upper
estimate of Korthikanti et al. (2022) without recomputation, ``bT h (34 +
5aT/h)`` bytes at 16 bits. With activation checkpointing a block keeps only
its input, plus one block's activations while it is recomputed. A pipeline
stage holds the activations of the micro-batches in flight there: all ``m`` of
a step under GPipe, ``min(m, R - k)`` at stage k under 1F1B.
"""

from __future__ import annotations

import math
import re

from aisyn.model.families import ModelConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: what a training process holds besides its model's tensors: the peak RSS of
#: ``aisyn train``, ``aisyn split train`` and ``aisyn split serve`` of the tiny
#: preset (the interpreter, torch 2.13 CPU, grpc, the data, the first step's
#: kernels, the loss plot), 345-375 MiB measured, less the planner's 3-33 MiB
#: for tiny's own tensors (``bench/scale.py``). A CUDA context adds its own.
RUNTIME_BYTES = 360 * 2**20
#: wire bytes per element of a cut tensor for each link codec (int8: one byte
#: plus one fp32 scale per 64 values)
CODEC_BYTES = {"none": None, "fp16": 2.0, "bf16": 2.0, "int8": 1.0 + 4.0 / 64}


class PlanError(ValueError):
    """Bad planner or cost-model input, or no cut fits the parties' memory."""


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str) -> float:
    """``80GB``, ``24GiB``, ``512MB``, ``inf`` -> bytes."""
    t = text.strip().lower()
    if t in ("inf", "unlimited"):
        return math.inf
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([kmgt]i?b|b)?", t)
    if not m:
        raise PlanError(f"memory {text!r}: expected e.g. 80GB, 24GiB, 512MB or inf")
    return float(m.group(1)) * _UNITS[m.group(2) or ""]


def format_bytes(n: float) -> str:
    if math.isinf(n):
        return "unlimited"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def block_forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Two FLOPs per matmul weight, plus attention's scores and weighted sum."""
    attention = cfg.num_heads * cfg.head_dim
    return 2.0 * cfg.block_matmul_weights + 4.0 * seq_len * attention


def head_forward_flops_per_token(cfg: ModelConfig) -> float:
    return 2.0 * cfg.hidden_size * cfg.vocab_size


def pipeline_stage_blocks(n_blocks: int, ranks: int) -> list[range]:
    """The contiguous blocks of each of ``ranks`` pipeline stages over
    ``n_blocks`` blocks: ``numpy.array_split``'s rule, the earlier stages
    taking the extra block (the planner's and the backbone pipeline's one
    rule). PlanError if a stage would get no block."""
    if ranks < 1:
        raise PlanError(f"{ranks} pipeline stages: need at least 1")
    if ranks > n_blocks:
        raise PlanError(
            f"{ranks} pipeline stages over {n_blocks} blocks: a stage would hold "
            f"no block; use at most {n_blocks} ranks"
        )
    base, extra = divmod(n_blocks, ranks)
    starts = [k * base + min(k, extra) for k in range(ranks + 1)]
    return [range(starts[k], starts[k + 1]) for k in range(ranks)]


def _exact_activations(cfg: ModelConfig) -> bool:
    """Whether ``block_activation_bytes`` counts this family's saved tensors
    exactly (PanGu-α's pre-LN block with exact GELU), not an upper estimate."""
    return cfg.layout.family == "pangu" and getattr(cfg, "activation", "") == "gelu"


def block_activation_bytes(
    cfg: ModelConfig,
    micro_batch: int,
    seq_len: int,
    dtype: str,
    *,
    autocast: bool = False,
) -> float:
    """Bytes autograd saves in one block's forward of ``micro_batch`` x
    ``seq_len`` tokens computed in ``dtype`` (``autocast``: bf16 autocast over
    fp32, ``dtype`` then fp32).

    PanGu-α: the inputs of ln_1 and ln_2, their outputs, q, k, v and the
    attention output (fused SDPA: with its log-sum-exp per head, no scores)
    are eight (B, T, h) tensors; the MLP's fc output and GELU output two
    (B, T, f); LayerNorm's mean and rstd two floats a token each. Under CPU
    bf16 autocast the LayerNorms' inputs and outputs stay fp32, the rest is
    bf16. Other families: Korthikanti et al. (2022), no recomputation.
    """
    tokens = micro_batch * seq_len
    h, a = cfg.hidden_size, cfg.num_heads
    if not _exact_activations(cfg):
        per_16bit = tokens * h * (34 + 5 * a * seq_len / h)
        return per_16bit * (2 if autocast else DTYPE_BYTES[dtype]) / 2
    f = cfg.ffn_size
    small = 4 * (4 + a)  # LayerNorm mean/rstd x 2, SDPA log-sum-exp per head
    if autocast:
        return tokens * (4 * 4 * h + 2 * (4 * h + 2 * f) + small)
    return tokens * (DTYPE_BYTES[dtype] * (8 * h + 2 * f) + small)


def block_input_bytes(
    cfg: ModelConfig, micro_batch: int, seq_len: int, dtype: str
) -> float:
    """What a checkpointed block keeps: its input, the residual stream (fp32
    under autocast)."""
    return micro_batch * seq_len * cfg.hidden_size * DTYPE_BYTES[dtype]


class ModuleSizes(dict):
    """``{module path: parameter count}``, and in ``shapes`` each module's
    parameters as ``(dim 0, numel)`` pairs: what FSDP2's dim-0 shards of it
    hold (``shard_params``)."""

    shapes: dict[str, tuple[tuple[int, int], ...]]

    def shard_count(self, path: str, rank: int, ranks: int) -> int:
        """``shard_params`` of ``path``, worked out once per rank: a plan
        weighs every rank of every cut, and a 200B model's cuts ask for the
        same few shards about a million times."""
        cache = self.__dict__.setdefault("_shard_counts", {})
        key = (path, rank, ranks)
        count = cache.get(key)
        if count is None:
            shapes = self.shapes.get(path, ((self[path], self[path]),))
            count = cache[key] = sum(
                dim0_chunk(d0, rank, ranks) * (numel // d0)
                for d0, numel in shapes
                if d0
            )
        return count


def module_sizes(model) -> ModuleSizes:
    """Parameter count (and shapes) of every submodule a partition names (a
    tied head is named by its embedding only, so it counts once)."""
    lay = model.config.layout
    blocks = (lay.block_path(i) for i in range(lay.num_blocks))
    paths = dict.fromkeys([*lay.embed, *blocks, *lay.head])
    out = ModuleSizes()
    out.shapes = {}
    for p in paths:
        params = list(model.get_submodule(p).parameters())
        out[p] = sum(x.numel() for x in params)
        out.shapes[p] = tuple((x.shape[0] if x.dim() else 1, x.numel()) for x in params)
    return out


def dim0_chunk(rows: int, rank: int, ranks: int) -> int:
    """Rows of dim 0 that rank ``rank`` of ``ranks`` keeps of a parameter of
    ``rows``: ``torch.chunk``'s k-th chunk, as FSDP2's ``Shard(0)`` cuts it
    (``ceil(rows / ranks)`` each, the last ranks fewer or none)."""
    size = -(-rows // ranks)
    return max(0, min(size, rows - rank * size))


def shard_params(sizes: dict[str, int], path: str, rank: int, ranks: int) -> int:
    """Parameters rank ``rank`` of ``ranks`` keeps of module ``path`` under
    FSDP2 (``dim0_chunk`` of each; from ``ModuleSizes.shapes``, or, for a
    plain dict of counts, of the module's count as one dim)."""
    if isinstance(sizes, ModuleSizes):
        return sizes.shard_count(path, rank, ranks)
    shapes = getattr(sizes, "shapes", {}).get(path, ((sizes[path], sizes[path]),))
    return sum(
        dim0_chunk(d0, rank, ranks) * (numel // d0) for d0, numel in shapes if d0
    )


def per_block_params(
    sizes: dict[str, int], lay, shard: tuple[int, int] | None = None
) -> list[int]:
    """Each ordinary block's parameter count, or (``shard=(k, R)``) rank k's
    ``shard_params`` of it, indexed by block: kept with a ``ModuleSizes``
    (a plan weighs every rank of every cut, about a million block lookups at
    200B, so each is worked out once)."""
    cache = getattr(sizes, "__dict__", {})
    key = ("per_block", lay.block, lay.num_blocks, shard)
    counts = cache.get(key)
    if counts is None:
        paths = [lay.block_path(i) for i in range(lay.num_blocks)]
        if shard is None:
            counts = [sizes[p] for p in paths]
        else:
            counts = [shard_params(sizes, p, *shard) for p in paths]
        cache[key] = counts
    return counts
