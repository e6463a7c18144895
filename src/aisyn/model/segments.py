"""Cut a model into contiguous segments that different parties hold.

A *partition* says which party holds which piece; a *segment* is an
``nn.Module`` that runs one contiguous piece (hidden states in, hidden states
out) on a model that may hold only some of its weights. Two shapes:

* **U-shape** (``u:F,K``): party A holds the embedding and the first ``F``
  ordinary blocks, party B the middle blocks, and A again the last ``K``
  ordinary blocks and the head (the final norm, PanGu-α's top query layer,
  the output projection).
  Tokens, labels and the loss never leave A, and the tied word embedding lives
  on A only. This is the shape split training uses.
* **two-way** (``two-way:F``): A holds the embedding and the first ``F``
  blocks, B everything after. B then needs the labels and also holds the tied
  word embedding (as its output projection), so the two copies must be kept
  equal. The planner sizes it; split training refuses it (see docs/split.md).

Where each piece lives is the model's ``Layout`` (``causal_lm.py``): this
module never asks which family it cuts. PanGu-α's ordinary blocks are
``transformer.h[0 .. L-2]``; ``h[L-1]``, its top query layer, always travels
with the head. Parameter names stay those of the whole model, so per-party
checkpoints merge by plain union.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
from torch import nn

from aisyn.model.causal_lm import (
    CausalLM,
    LayerKV,
    Layout,
    check_capacity,
    parameter_seed,
)
from aisyn.model.families import ModelConfig, build_model
from aisyn.validate import name_differences

DATA_PARTY = "A"
COMPUTE_PARTY = "B"
PARTIES = (DATA_PARTY, COMPUTE_PARTY)


class PartitionError(ValueError):
    """A partition that does not fit the model (or cannot be parsed)."""


@dataclass(frozen=True)
class Stage:
    """One contiguous piece run by one party, in forward order."""

    party: str
    blocks: range  # ordinary blocks h[i] it runs
    embed: bool = False  # starts with the word + position embedding
    head: bool = False  # ends with final LN + top query layer (+ tied head)

    def describe(self, layout: Layout) -> str:
        parts = []
        if self.embed:
            parts.append("embedding")
        if len(self.blocks):
            parts.append(f"h[{self.blocks.start}:{self.blocks.stop}]")
        if self.head:
            parts.append(layout.head_label)
        return f"{self.party}: " + " + ".join(parts)


@dataclass(frozen=True)
class Partition:
    """Where a model (of ``layout``) is cut.

    ``back`` is the number of ordinary blocks A runs before the head (U-shape);
    ``back=None`` is the plain two-way cut (B keeps everything after ``front``).
    """

    layout: Layout
    front: int
    back: int | None = 0
    #: the blocks of B's middle that one rank of a pipelined compute party
    #: holds (``rank_share``); None: all of them. Not part of the cut the
    #: parties agree on (``to_dict``): a data party cannot tell.
    share: range | None = None

    def __post_init__(self) -> None:
        n = self.num_blocks
        if self.front < 0 or (self.back is not None and self.back < 0):
            raise PartitionError(f"{self.spec}: block counts must be >= 0")
        taken = self.front + (self.back or 0)
        if taken >= n:
            raise PartitionError(
                f"{self.spec}: party B would hold no block (the model has {n} "
                f"ordinary blocks before its head; A takes {taken})"
            )
        if self.share is not None and not (
            len(self.share)
            and self.share.step == 1
            and self.middle.start <= self.share.start
            and self.share.stop <= self.middle.stop
        ):
            raise PartitionError(
                f"{self.spec}: a rank's share {self.share} is not a non-empty "
                f"run of B's blocks {self.middle}"
            )

    def rank_share(self, blocks: range) -> Partition:
        """This cut as one rank of a pipelined compute party sees it: party B
        holds only ``blocks`` of its middle (the rest stays on meta)."""
        return replace(self, share=blocks)

    @property
    def num_blocks(self) -> int:
        """Ordinary blocks (PanGu-α: all layers but the top query layer)."""
        return self.layout.num_blocks

    @property
    def is_u_shape(self) -> bool:
        return self.back is not None

    @property
    def spec(self) -> str:
        return (
            f"u:{self.front},{self.back}"
            if self.is_u_shape
            else (f"two-way:{self.front}")
        )

    @property
    def middle(self) -> range:
        """Ordinary blocks on party B."""
        return range(self.front, self.num_blocks - (self.back or 0))

    @property
    def stages(self) -> tuple[Stage, ...]:
        n = self.num_blocks
        first = Stage(DATA_PARTY, range(0, self.front), embed=True)
        if not self.is_u_shape:
            return first, Stage(COMPUTE_PARTY, self.middle, head=True)
        return (
            first,
            Stage(COMPUTE_PARTY, self.middle if self.share is None else self.share),
            Stage(DATA_PARTY, range(n - self.back, n), head=True),
        )

    def stages_of(self, party: str) -> tuple[Stage, ...]:
        check_party(party)
        return tuple(s for s in self.stages if s.party == party)

    def module_paths(self, party: str) -> list[str]:
        """Submodules of the model that ``party`` materialises."""
        lay = self.layout
        paths: list[str] = []
        for stage in self.stages_of(party):
            if stage.embed:
                paths += list(lay.embed)
            paths += [lay.block_path(i) for i in stage.blocks]
            if stage.head:
                paths += [p for p in lay.head if p not in paths]
        return paths

    def parameter_names(self, model: nn.Module, party: str) -> list[str]:
        """Names (as in ``model.named_parameters()``) of ``party``'s parameters."""
        prefixes = tuple(p + "." for p in self.module_paths(party))
        return [n for n, _ in model.named_parameters() if n.startswith(prefixes)]

    def shared_parameter_names(self, model: nn.Module) -> list[str]:
        """Parameters both parties hold (the tied word embedding of a two-way
        cut), which the two copies must keep equal."""
        theirs = set(self.parameter_names(model, COMPUTE_PARTY))
        return [n for n in self.parameter_names(model, DATA_PARTY) if n in theirs]

    def describe(self) -> str:
        return " | ".join(s.describe(self.layout) for s in self.stages)

    def to_dict(self) -> dict:
        """The cut as the parties compare it: family, depth and block counts."""
        return {
            "family": self.layout.family,
            "num_layers": self.layout.num_layers,
            "front": self.front,
            "back": self.back,
        }

    @classmethod
    def from_dict(cls, d: dict, layout: Layout) -> Partition:
        """The cut ``d`` (``to_dict``) of a model of ``layout``."""
        try:
            part = cls(layout, int(d["front"]), d.get("back"))
            same = d["num_layers"] == layout.num_layers
        except (KeyError, TypeError) as e:
            raise PartitionError(f"bad partition record {d!r} ({e})") from None
        if not same or d.get("family", "pangu") != layout.family:
            raise PartitionError(
                f"cut {part.spec} was made for a {d.get('family', 'pangu')} model of "
                f"{d['num_layers']} layers, this is a {layout.family} model of "
                f"{layout.num_layers}"
            )
        return part


_SPEC = re.compile(r"^(?:u:(\d+),(\d+)|two-way:(\d+))$")


def parse_partition(spec: str, cfg: ModelConfig) -> Partition:
    """``u:F,K`` (U-shape) or ``two-way:F`` for a model of ``cfg``'s layout."""
    m = _SPEC.match(spec.strip())
    if not m:
        raise PartitionError(
            f"cut {spec!r}: expected 'u:FRONT,BACK' (e.g. u:1,1) or 'two-way:FRONT'"
        )
    if m.group(3) is not None:
        return Partition(cfg.layout, int(m.group(3)), None)
    return Partition(cfg.layout, int(m.group(1)), int(m.group(2)))


def check_party(party: str) -> None:
    if party not in PARTIES:
        raise PartitionError(f"unknown party {party!r} (known: {', '.join(PARTIES)})")


def share_frozen(
    model: nn.Module, names: list[str], tensors: dict[str, torch.Tensor]
) -> None:
    """Make each parameter ``names`` of ``model`` (on meta) a frozen parameter
    over the memory of ``tensors[name]`` (same shape; cast only if its dtype
    differs, which copies)."""
    if diff := name_differences(names, tensors):
        raise PartitionError(f"frozen weights are not this party's ({diff})")
    for name in names:
        prefix, _, leaf = name.rpartition(".")
        module = model.get_submodule(prefix)
        old, t = module._parameters[leaf], tensors[name]
        if old is None or tuple(old.shape) != tuple(t.shape):
            raise PartitionError(
                f"frozen weight {name}: shape {tuple(t.shape)}, the model's is "
                f"{None if old is None else tuple(old.shape)}"
            )
        module._parameters[leaf] = nn.Parameter(t.to(old.dtype), requires_grad=False)


def build_party_model(
    cfg: ModelConfig,
    partition: Partition,
    party: str,
    *,
    seed: int | None = None,
    seeds: dict[str, int] | None = None,
    device: str | torch.device = "cpu",
    frozen: dict[str, torch.Tensor] | None = None,
) -> CausalLM:
    """The model with only ``party``'s modules materialised, the rest on meta.

    Each parameter is initialised exactly as ``build_model(cfg, seed=seed)``
    would (per-parameter seeded init), so a split run starts from the same
    weights as the unsplit one without ever allocating the other party's part.
    A party that must not know the run's seed gets ``seeds`` instead: the
    per-parameter seeds of exactly its own parameters (``init_seeds``).

    ``frozen``: the party's weights themselves, already on ``device``; its
    parameters then share their memory (nothing is allocated), so several
    models -- one per LoRA session over one base -- hold one copy. They are
    frozen (``requires_grad`` off) and must never be written to.
    """
    if partition.layout != cfg.layout:
        raise PartitionError(
            f"partition {partition.spec} is for a {partition.layout.family} model "
            f"of {partition.layout.num_layers} layers, not this "
            f"{cfg.layout.family} model of {cfg.layout.num_layers}"
        )
    model = build_model(cfg, device="meta")
    if frozen is not None:
        share_frozen(model, partition.parameter_names(model, party), frozen)
        model.tie_weights()
        return model
    if (seed is None) == (seeds is None):
        raise TypeError("build_party_model takes either seed or seeds")
    for path in partition.module_paths(party):
        model.get_submodule(path).to_empty(device=device)
    # to_empty replaced the embedding's weight; a tied head still points at
    # the meta one (and a tie to a module this party lacks stays on meta).
    model.tie_weights()
    own = partition.parameter_names(model, party)
    if seeds is not None:
        if diff := name_differences(own, seeds):
            raise PartitionError(
                f"init seeds are not party {party}'s parameters ({diff})"
            )
        model.reset_parameters(seeds=seeds)
    else:
        model.reset_parameters(seed, names=own)
    return model


def init_seeds(
    cfg: ModelConfig, partition: Partition, party: str, seed: int
) -> dict[str, int]:
    """Per-parameter init seeds of ``party``'s parameters in a run seeded with
    ``seed``: what the data party hands the compute party instead of the seed."""
    model = build_model(cfg, device="meta")
    return {
        name: parameter_seed(seed, name)
        for name in partition.parameter_names(model, party)
    }


def own_named_parameters(
    model: nn.Module, partition: Partition, party: str
) -> list[tuple[str, nn.Parameter]]:
    names = set(partition.parameter_names(model, party))
    return [(n, p) for n, p in model.named_parameters() if n in names]


def own_state_dict(
    model: nn.Module, partition: Partition, party: str
) -> dict[str, torch.Tensor]:
    """``party``'s tensors (parameters and buffers) keyed by full-model names."""
    prefixes = tuple(p + "." for p in partition.module_paths(party))
    seen: set[int] = set()
    out = {}
    for name, t in model.state_dict().items():
        if not name.startswith(prefixes) or t.is_meta:
            continue
        key = t.untyped_storage().data_ptr()
        if key in seen:  # the tied head: stored once, as transformer.wte.weight
            continue
        seen.add(key)
        out[name] = t.detach().contiguous()
    return out


def own_tensor_shapes(
    cfg: ModelConfig, partition: Partition, party: str
) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors ``own_state_dict`` gives for ``party``,
    without allocating any (e.g. to read just those from a whole checkpoint)."""
    model = build_model(cfg, device="meta")
    prefixes = tuple(p + "." for p in partition.module_paths(party))
    # The tied lm_head.weight lies outside every prefix: transformer.wte.weight.
    return {
        n: tuple(t.shape)
        for n, t in model.state_dict().items()
        if n.startswith(prefixes)
    }


class StageCache:
    """One stage's share of a generation's KV cache: keys and values of exactly
    the layers the stage runs (its blocks, then the top query layer for a head
    stage), for one sequence of up to ``capacity`` positions.

    Each party of a split model keeps its own: no keys or values cross, only
    the hidden states of the new positions. ``length`` counts positions run,
    also for a stage without layers (an embedding-only front).
    """

    def __init__(self, layers: list[LayerKV], capacity: int) -> None:
        self.layers = layers
        self.capacity = capacity
        self.length = 0


class Segment(nn.Module):
    """Runs one stage of a (partly materialised) model.

    ``forward(x, attn_mask, position_ids)``: token ids (B, T) if the stage
    starts with the embedding, else hidden states (B, T, C); returns hidden
    states (B, T, C) -- after the head's own layers for a head stage (apply
    ``logits`` for the vocabulary). The ops are exactly those of
    ``CausalLM.hidden``, so chaining the stages reproduces the unsplit model.
    The model is held by reference, not registered, so parameter names stay
    the model's own.
    """

    def __init__(self, model: CausalLM, stage: Stage) -> None:
        super().__init__()
        self._model = (model,)
        self.stage = stage

    @property
    def model(self) -> CausalLM:
        return self._model[0]

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: StageCache | None = None,
    ) -> torch.Tensor:
        """With ``cache`` (``new_cache``), ``x`` holds only the positions after
        the cached ones, run exactly as ``CausalLM.hidden(..., cache=...)``
        runs them; the cache grows by them."""
        if cache is not None:
            return self._forward_cached(x, cache)
        m = self.model
        ctx = m.context(x.shape[1], attn_mask, position_ids, x.device)
        if self.stage.embed:
            x = m.embed(x, position_ids)
        for i in self.stage.blocks:
            x = m.block(i, x, ctx)
        if self.stage.head:
            x = m.finish(x, ctx)
        return x

    def _forward_cached(self, x: torch.Tensor, cache: StageCache) -> torch.Tensor:
        start, T = cache.length, x.shape[1]
        if start + T > cache.capacity:
            raise ValueError(
                f"{start} cached + {T} new positions exceed the KV cache's "
                f"{cache.capacity}"
            )
        m = self.model
        positions = torch.arange(start, start + T, device=x.device).unsqueeze(0)
        ctx = m.context(T, None, positions, x.device)
        kvs = iter(cache.layers)
        if self.stage.embed:
            x = m.embed(x, positions)
        for i in self.stage.blocks:
            x = m.block(i, x, ctx, next(kvs))
        if self.stage.head:
            x = m.finish(x, ctx, list(kvs))
        cache.length = start + T
        return x

    def new_cache(self, capacity: int, batch_size: int = 1) -> StageCache:
        """An empty ``StageCache`` for this stage's layers, on the device and in
        the dtype of its weights, for up to ``capacity`` positions (at most
        ``seq_len``)."""
        cfg = self.model.config
        check_capacity(capacity, cfg.seq_len)
        n = len(self.stage.blocks) + (cfg.layout.head_layers if self.stage.head else 0)
        if n == 0:
            return StageCache([], capacity)
        lay = cfg.layout
        path = (
            lay.block_path(self.stage.blocks.start)
            if len(self.stage.blocks)
            else lay.head[-1]
        )
        w = next(self.model.get_submodule(path).parameters())
        kvs = [
            LayerKV.empty(cfg, capacity, batch_size, w.device, w.dtype)
            for _ in range(n)
        ]
        return StageCache(kvs, capacity)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.stage.head:
            raise RuntimeError("logits() needs the head stage")
        return self.model.logits(hidden)

    def extra_repr(self) -> str:
        return self.stage.describe(self.model.config.layout)


def segments_of(
    model: CausalLM, partition: Partition, party: str
) -> tuple[Segment, ...]:
    return tuple(Segment(model, s) for s in partition.stages_of(party))
