"""What each rank of a party holds at the peak of a step, and what the party
computes and sends: the memory model the planner, the centre's admission and
the trainers' up-front memory check share (``model.cost`` gives the pieces).

Memory, per rank of a party, is the peak of one optimizer step:

    runtime + weights + grads + optimizer + gathered block + autocast cache
    + activations

A party on R devices is laid out as it runs (``party_layout``):

* ``one`` (R = 1): one process holds the party's layers whole.
* ``pipeline`` (the compute party B, R <= its layers): R pipeline stages
  (``pipeline_stage_blocks``), each holding its stage's layers whole
  (``split.backbone.pipeline.PipelinedRounds``).
* ``sharded`` (B with more devices than layers, ``split.backbone.pipeline.
  ShardedRounds``; the data party A on any R > 1, ``split.client.data_ranks``): the
  party's ordinary blocks FSDP2-sharded over all R ranks (``split.sharding.
  shard_blocks``). Rank k keeps FSDP2's dim-0 chunk k (``torch.chunk``:
  ``ceil(d0 / R)`` rows of each parameter, fewer on the last ranks, so the
  ranks' shares sum to the blocks exactly; FSDP2's padding of the last
  chunks is not counted) of every block's weights and AdamW moments, plus,
  while it runs a block, that block's whole weights (FSDP2's all-gather: one
  block counted, ``gathered``). A's gradients are reduce-scattered every
  backward, so they are sharded like the weights; B's accumulate unsharded
  over the step's micro-batches and are reduce-scattered in its last
  backward only, so a rank of B holds the whole blocks' gradients. The
  party's other pieces (the "ends": embedding and position embeddings,
  final norm, head and PanGu-α's top query layer) stay whole on every rank
  with their gradients and AdamW state. Every rank runs its share of each
  micro-batch's rows (``torch.tensor_split``: ``ceil(mb / R)`` on the first
  ranks), so a micro-batch needs at least R rows, and it holds the
  activations of its rows of the link's window of micro-batches
  (``Workload.in_flight``) for every layer it runs, the head's logits
  included.

weights and gradients in the parameter dtype; AdamW moments (2 x fp32, plus
an fp32 master copy when parameters are 16-bit); under bf16 autocast a bf16
copy of every matrix the blocks multiply by (autocast's cache, held until the
step's backward ends); ``runtime`` is what a training process holds besides
its model (``RUNTIME_BYTES``). Backward frees each block's activations as it
allocates that block's gradients, but on CPU glibc keeps the freed heap
memory resident, so a process's peak RSS is the sum (measured on 350M's
width: within 1 % of VmHWM for 6 blocks); a caching GPU allocator reuses
some of it, so there the sum is an upper estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from aisyn.model.cost import (
    CODEC_BYTES,
    DTYPE_BYTES,
    RUNTIME_BYTES,
    PlanError,
    block_activation_bytes,
    block_forward_flops_per_token,
    block_input_bytes,
    head_forward_flops_per_token,
    per_block_params,
    pipeline_stage_blocks,
)
from aisyn.model.families import ModelConfig
from aisyn.model.segments import COMPUTE_PARTY, DATA_PARTY, Partition, Stage

#: pipeline schedules whose activation memory the planner knows: GPipe (all
#: forwards, then all backwards: every stage holds every micro-batch), 1F1B
#: (stage k of R holds at most R - k), and the link's window (every stage
#: runs the order of a one-device party for A's ``--pipeline`` window, as
#: ``aisyn split serve`` under torchrun does: each holds ``in_flight``)
SCHEDULES = ("gpipe", "1f1b", "window")
#: how a party's layers lie on its devices (``party_layout``; the module
#: docstring describes each)
LAYOUTS = ("one", "pipeline", "sharded")


@dataclass(frozen=True)
class Workload:
    batch_size: int = 8  # samples per optimizer step
    micro_batch_size: int = 1
    seq_len: int | None = None  # None: the model's
    dtype: str = "fp32"  # parameters, gradients and activations
    codec: str = "none"  # cut-layer compression on the link
    in_flight: int = 1  # micro-batches a one-device party holds at once
    eod_reset: bool = False
    autocast: bool = False  # bf16 autocast over fp32 parameters (dtype fp32)
    activation_checkpointing: bool = False  # blocks recompute in backward
    schedule: str = "gpipe"  # of a party's pipeline stages (``SCHEDULES``)
    runtime_bytes: float = RUNTIME_BYTES  # per process (``RUNTIME_BYTES``)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            known = ", ".join(DTYPE_BYTES)
            raise PlanError(f"dtype {self.dtype!r}: use one of {known}")
        if self.codec not in CODEC_BYTES:
            known = ", ".join(CODEC_BYTES)
            raise PlanError(f"codec {self.codec!r}: use one of {known}")
        if self.batch_size < 1 or self.micro_batch_size < 1:
            raise PlanError("batch and micro-batch sizes must be >= 1")
        if self.batch_size % self.micro_batch_size:
            raise PlanError(
                f"micro-batch size {self.micro_batch_size} must divide batch size "
                f"{self.batch_size}"
            )
        if self.in_flight < 1:
            raise PlanError("in_flight must be >= 1")
        if self.autocast and self.dtype != "fp32":
            raise PlanError(
                f"autocast keeps fp32 parameters: it needs dtype fp32, not "
                f"{self.dtype} (which already computes in {self.dtype})"
            )
        if self.schedule not in SCHEDULES:
            known = ", ".join(SCHEDULES)
            raise PlanError(f"schedule {self.schedule!r}: use one of {known}")
        if not self.runtime_bytes >= 0 or math.isinf(self.runtime_bytes):
            raise PlanError("runtime_bytes must be finite and >= 0")

    @property
    def micro_batches(self) -> int:
        return self.batch_size // self.micro_batch_size

    @property
    def wire_bytes_per_value(self) -> float:
        return CODEC_BYTES[self.codec] or float(DTYPE_BYTES[self.dtype])

    @property
    def act_dtype(self) -> str:
        """The dtype the blocks compute in."""
        return "bf16" if self.autocast else self.dtype


@dataclass
class RankLoad:
    """What one device of a party holds at the peak of a step."""

    rank: int
    #: the party's blocks here (``pipeline_stage_blocks``), whole or (``shard``)
    #: a shard of each
    blocks: tuple[int, ...]
    #: [embedding or "", head label or ""]
    head_pieces: list[str] = field(default_factory=lambda: ["", ""])
    params: int = 0  # held here: the whole pieces, and its shards of the blocks
    in_flight: int = 1  # micro-batches whose activations it holds
    weights_bytes: float = 0.0
    grads_bytes: float = 0.0
    optimizer_bytes: float = 0.0  # AdamW moments (+ fp32 master)
    cache_bytes: float = 0.0  # autocast's bf16 copies of the weights
    activation_bytes: float = 0.0
    runtime_bytes: float = 0.0
    #: (k, R): the blocks are FSDP2-sharded over R ranks, this is rank k;
    #: None: they are whole here
    shard: tuple[int, int] | None = None
    shard_params: int = 0  # of ``params``: its dim-0 chunks of the blocks'
    gathered_bytes: float = 0.0  # one block's whole weights, all-gathered
    rows: int = 0  # of each micro-batch, whose activations it holds

    def describe(self) -> str:
        """``embedding + h[0:3] + h[29:31] + head``."""
        return _pieces(self)

    @property
    def memory_bytes(self) -> float:
        """The step's peak (see the module docstring)."""
        return (
            self.runtime_bytes
            + self.weights_bytes
            + self.grads_bytes
            + self.optimizer_bytes
            + self.gathered_bytes
            + self.cache_bytes
            + self.activation_bytes
        )


@dataclass
class PartyLoad:
    """What one party holds and does per optimizer step (memory summed over
    its ranks; ``memory_bytes`` is its largest rank's peak)."""

    name: str
    params: int = 0
    layout: str = "one"  # ``LAYOUTS``: how its layers lie on its devices
    train_flops: float = 0.0  # per optimizer step
    weights_bytes: float = 0.0
    grads_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    activation_bytes: float = 0.0
    sent_bytes: float = 0.0  # per optimizer step, to the other party
    received_bytes: float = 0.0
    pieces: list[str] = field(default_factory=list)
    ranks: list[RankLoad] = field(default_factory=list)

    @property
    def memory_bytes(self) -> float:
        return max(r.memory_bytes for r in self.ranks)

    @property
    def largest_rank(self) -> RankLoad:
        return max(self.ranks, key=lambda r: r.memory_bytes)


def _pieces(r: RankLoad) -> str:
    """``embedding + h[0:3] + h[29:31] + top query``: consecutive blocks as
    one range."""
    runs: list[list[int]] = []
    for i in r.blocks:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    blocks = [f"h[{a}:{b}]" for a, b in runs]
    pieces = [r.head_pieces[0], *blocks, r.head_pieces[1]]
    if r.shard and blocks:  # the shard first, then what is whole
        k, ranks = r.shard
        pieces = [f"FSDP2 shard {k + 1}/{ranks} of {' '.join(blocks)}", *r.head_pieces]
    return " + ".join(p for p in pieces if p)


def rank_load(
    sizes: dict[str, int],
    cfg: ModelConfig,
    w: Workload,
    blocks: list[int],
    *,
    embed: bool,
    head: bool,
    rank: int = 0,
    in_flight: int | None = None,
    shard: tuple[int, int] | None = None,
    sharded_grads: bool = True,
) -> RankLoad:
    """The memory of one process holding ``blocks`` (and the embedding, the
    head) for one step of ``w``: a rank of a party, or (all blocks, embedding
    and head) the unsplit model.

    ``shard=(k, R)``: the blocks are FSDP2-sharded over R ranks and this is
    rank k (the module docstring's ``sharded`` layout): it keeps its dim-0
    chunks of the blocks' weights and AdamW state, one block's whole weights
    while gathered, its gradients sharded too (``sharded_grads``) or whole,
    and the activations of its rows of each micro-batch; the embedding and
    the head stay whole."""
    lay = cfg.layout
    T, mb = w.seq_len or cfg.seq_len, w.micro_batch_size
    dt, act_dt = DTYPE_BYTES[w.dtype], DTYPE_BYTES[w.act_dtype]
    block_sizes = per_block_params(sizes, lay)
    ends: list[str] = []
    r = RankLoad(rank, tuple(blocks), shard=shard)
    if embed:
        ends += list(lay.embed)
        r.head_pieces[0] = "embedding"
    if head:
        ends += list(lay.head)
        r.head_pieces[1] = lay.head_label
    if shard is None:
        block_paths = [lay.block_path(i) for i in blocks]
        r.params = sum(sizes[p] for p in dict.fromkeys(block_paths + ends))
        grads = r.params
    else:
        k, ranks = shard
        mb = mb // ranks + (k < mb % ranks)  # tensor_split's rows: ceil first
        whole = sum(sizes[p] for p in dict.fromkeys(ends))
        shards = per_block_params(sizes, lay, shard)
        r.shard_params = sum(shards[i] for i in blocks)
        r.params = whole + r.shard_params
        full = sum(block_sizes[i] for i in blocks)
        grads = r.params if sharded_grads else whole + full
        largest = max((block_sizes[i] for i in blocks), default=0)
        r.gathered_bytes = largest * dt
    r.rows = mb
    r.in_flight = w.in_flight if in_flight is None else in_flight
    r.weights_bytes = r.params * dt
    r.grads_bytes = grads * dt
    r.optimizer_bytes = r.params * (8 + (0 if w.dtype == "fp32" else 4))
    r.runtime_bytes = w.runtime_bytes
    n_layers = len(blocks) + (lay.head_layers if head else 0)
    block = block_activation_bytes(cfg, mb, T, w.dtype, autocast=w.autocast)
    if w.autocast:
        # autocast's bf16 copy of each matrix a block (or the head) uses
        matrices = n_layers * cfg.block_matmul_weights
        if head:
            matrices += cfg.vocab_size * cfg.hidden_size
        r.cache_bytes = 2.0 * matrices
    if w.activation_checkpointing:
        per_micro = n_layers * block_input_bytes(cfg, mb, T, w.dtype)
        once = block if n_layers else 0.0  # the block being recomputed
    else:
        per_micro, once = n_layers * block, 0.0
    if head:
        # the final LayerNorm's input and the top layer's query, then the
        # logits in the compute dtype and log-softmax's fp32 output
        per_micro += 2 * mb * T * cfg.hidden_size * act_dt
        per_micro += mb * T * cfg.vocab_size * (act_dt + 4)
    if embed:
        per_micro += mb * T * 16  # the token and position ids (int64)
    r.activation_bytes = per_micro * r.in_flight + once
    return r


def _in_flight(w: Workload, rank: int, ranks: int) -> int:
    """Micro-batches whose activations stage ``rank`` of ``ranks`` holds."""
    if ranks == 1 or w.schedule == "window":
        return w.in_flight  # the link's pipelining window
    m = w.micro_batches
    return m if w.schedule == "gpipe" else min(m, ranks - rank)


def party_layout(party: str, layers: int, devices: int) -> str:
    """How a party with ``layers`` layers (its ordinary blocks, and PanGu-α's
    top query layer where it holds the head) lies on ``devices`` devices, as
    its torchrun job runs it (``LAYOUTS``; the module docstring): the data
    party is sharded on more than one, the compute party pipelined up to one
    device per layer and sharded beyond."""
    if devices < 1:
        raise PlanError(f"{devices} devices: need at least 1")
    if devices == 1:
        return "one"
    if party == DATA_PARTY or devices > layers:
        return "sharded"
    return "pipeline"


def party_load(
    sizes: dict[str, int],
    cfg: ModelConfig,
    partition: Partition,
    party: str,
    workload: Workload,
    devices: int = 1,
    *,
    peak_only: bool = False,
) -> PartyLoad:
    """Parameters, FLOPs, memory (per rank, in the layout ``party_layout``
    gives ``devices``) and traffic of one party for one step. PlanError if
    the layout cannot run the workload (sharded ranks with fewer rows in a
    micro-batch than ranks). ``peak_only``: only the ranks that can hold the
    peak (the first and the last: the first holds the most rows and chunks,
    the most blocks and micro-batches of a pipeline, and the embedding; the
    last the head), so ``memory_bytes`` is right; its sums, parameters and
    FLOPs are not worked out."""
    w, T = workload, workload.seq_len or cfg.seq_len
    lay = cfg.layout
    tokens = w.batch_size * T
    ld = PartyLoad(party)
    stages: list[Stage] = list(partition.stages_of(party))
    fwd_per_token = 0.0
    for stage in [] if peak_only else stages:
        ld.pieces.append(stage.describe(lay))
        n_blocks = len(stage.blocks) + (lay.head_layers if stage.head else 0)
        fwd_per_token += n_blocks * block_forward_flops_per_token(cfg, T)
        if stage.head:
            fwd_per_token += head_forward_flops_per_token(cfg)
    ld.train_flops = 3.0 * fwd_per_token * tokens
    if not peak_only:
        ld.params = sum(sizes[p] for p in partition.module_paths(party))
    # The party's layers in forward order (the head's own, PanGu-α's top
    # query layer, last). Pipelined, they are spread over its ranks; the
    # embedding goes to the first rank, the rest of the head to the last (a
    # tied head's embedding is then held by both, as Megatron-LM keeps it).
    # Sharded, every rank holds a shard of each block and the rest whole.
    embed = any(st.embed for st in stages)
    head = any(st.head for st in stages)
    layers = [i for st in stages for i in st.blocks]
    layers += [lay.num_blocks + j for j in range(lay.head_layers if head else 0)]
    ld.layout = party_layout(party, len(layers), devices)
    ranks = sorted({0, devices - 1}) if peak_only else range(devices)
    _rank_loads(ld, sizes, cfg, w, layers, devices, ranks, embed=embed, head=head)
    for name in ("weights_bytes", "grads_bytes", "optimizer_bytes"):
        setattr(ld, name, sum(getattr(r, name) for r in ld.ranks))
    ld.activation_bytes = sum(r.activation_bytes for r in ld.ranks)
    ld.sent_bytes, ld.received_bytes = _traffic(cfg, partition, party, w, T)
    return ld


def _rank_loads(
    ld: PartyLoad,
    sizes: dict[str, int],
    cfg: ModelConfig,
    w: Workload,
    layers: list[int],
    devices: int,
    ranks: range | list[int],
    *,
    embed: bool,
    head: bool,
) -> None:
    """The ranks of a party on one device, pipelined over ``devices`` (each
    stage its share of ``layers``, the embedding on the first, the head on
    the last), or with its blocks FSDP2-sharded over them (every rank holds
    all of them, a shard of each)."""
    sharded = ld.layout == "sharded"
    if sharded and w.micro_batch_size < devices:
        who = "data party" if ld.name == DATA_PARTY else "compute party"
        more = f"; or give B at most {len(layers)} devices (pipeline stages)"
        raise PlanError(
            f"the {who} on {devices} devices shards its blocks (FSDP2) and "
            f"shares each micro-batch's rows over them: micro-batches of "
            f"{w.micro_batch_size} row(s) would leave ranks idle; use a "
            f"micro-batch size of at least {devices}"
            + (more if ld.name == COMPUTE_PARTY else "")
        )
    spread = (
        pipeline_stage_blocks(len(layers), devices) if ld.layout == "pipeline" else None
    )
    n_blocks = cfg.layout.num_blocks
    for k in ranks:
        idx = [layers[i] for i in spread[k]] if spread else layers
        ld.ranks.append(
            rank_load(
                sizes,
                cfg,
                w,
                [i for i in idx if i < n_blocks],
                embed=embed and (sharded or k == 0),
                head=head and (sharded or k == devices - 1),
                rank=k,
                # sharded, every rank runs the link's window
                in_flight=w.in_flight if sharded else _in_flight(w, k, devices),
                shard=(k, devices) if sharded else None,
                # A reduce-scatters every backward; B once, in the last
                sharded_grads=ld.name == DATA_PARTY,
            )
        )


def _traffic(
    cfg: ModelConfig, partition: Partition, party: str, w: Workload, T: int
) -> tuple[float, float]:
    """(sent, received) bytes per optimizer step for ``party``, payload only."""
    cut = w.batch_size * T * cfg.hidden_size * w.wire_bytes_per_value
    # Each cut crossing carries an activation one way and its gradient back.
    # U-shape: A->B act(front) + grad(out of B); B->A out(B) + grad(input of B).
    a_to_b = 2 * cut
    b_to_a = 2 * cut
    if w.eod_reset:
        a_to_b += w.batch_size * T * 4  # int32 document index per position
    if not partition.is_u_shape:
        # Two-way: one crossing each way (act A->B, its gradient B->A), the
        # labels (int64) to B, and both halves of the tied embedding's gradient.
        tied = cfg.vocab_size * cfg.hidden_size * DTYPE_BYTES[w.dtype]
        a_to_b = cut + w.batch_size * T * 8 + tied
        b_to_a = cut + tied
        if w.eod_reset:
            a_to_b += w.batch_size * T * 4
    return (a_to_b, b_to_a) if party == DATA_PARTY else (b_to_a, a_to_b)
