"""Cut PanGu-α into contiguous segments that different parties hold.

A *partition* says which party holds which piece; a *segment* is an
``nn.Module`` that runs one contiguous piece (hidden states in, hidden states
out) on a model that may hold only some of its weights. Two shapes:

* **U-shape** (``u:F,K``): party A holds the embedding and the first ``F``
  ordinary blocks, party B the middle blocks, and A again the last ``K``
  ordinary blocks, the final LayerNorm, the top query layer and the tied head.
  Tokens, labels and the loss never leave A, and the tied word embedding lives
  on A only. This is the shape split training uses.
* **two-way** (``two-way:F``): A holds the embedding and the first ``F``
  blocks, B everything after. B then needs the labels and also holds the tied
  word embedding (as its output projection), so the two copies must be kept
  equal. The planner sizes it; split training refuses it (see docs/split.md).

Ordinary blocks are ``transformer.h[0 .. L-2]``; ``h[L-1]`` is the top query
layer, which always travels with the head. Parameter names stay those of the
whole model, so per-party checkpoints merge by plain union.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from aisyn.model.pangu import (
    LayerKV,
    PanguAlpha,
    PanguConfig,
    build_model,
    parameter_seed,
)

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

    def describe(self, num_layers: int) -> str:
        parts = []
        if self.embed:
            parts.append("embedding")
        if len(self.blocks):
            parts.append(f"h[{self.blocks.start}:{self.blocks.stop}]")
        if self.head:
            parts.append(f"ln_f + top query h[{num_layers - 1}] + head")
        return f"{self.party}: " + " + ".join(parts)


@dataclass(frozen=True)
class Partition:
    """Where a model of ``num_layers`` layers is cut.

    ``back`` is the number of ordinary blocks A runs before the head (U-shape);
    ``back=None`` is the plain two-way cut (B keeps everything after ``front``).
    """

    num_layers: int
    front: int
    back: int | None = 0

    def __post_init__(self) -> None:
        n = self.num_blocks
        if self.front < 0 or (self.back is not None and self.back < 0):
            raise PartitionError(f"{self.spec}: block counts must be >= 0")
        taken = self.front + (self.back or 0)
        if taken >= n:
            raise PartitionError(
                f"{self.spec}: party B would hold no block (the model has {n} "
                f"ordinary blocks besides the top query layer; A takes {taken})"
            )

    @property
    def num_blocks(self) -> int:
        """Ordinary blocks (all layers except the top query layer)."""
        return self.num_layers - 1

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
            Stage(COMPUTE_PARTY, self.middle),
            Stage(DATA_PARTY, range(n - self.back, n), head=True),
        )

    def stages_of(self, party: str) -> tuple[Stage, ...]:
        check_party(party)
        return tuple(s for s in self.stages if s.party == party)

    def module_paths(self, party: str) -> list[str]:
        """Submodules of ``PanguAlpha`` that ``party`` materialises."""
        paths: list[str] = []
        for stage in self.stages_of(party):
            if stage.embed:
                paths += ["transformer.wte", "transformer.wpe"]
            paths += [f"transformer.h.{i}" for i in stage.blocks]
            if stage.head:
                # The head is tied to wte: a head holder also holds wte.
                if "transformer.wte" not in paths:
                    paths.append("transformer.wte")
                paths += [
                    "transformer.ln_f",
                    "transformer.wqe",
                    f"transformer.h.{self.num_layers - 1}",
                ]
        return paths

    def parameter_names(self, model: nn.Module, party: str) -> list[str]:
        """Names (as in ``model.named_parameters()``) of ``party``'s parameters."""
        prefixes = tuple(p + "." for p in self.module_paths(party))
        return [n for n, _ in model.named_parameters() if n.startswith(prefixes)]

    def shared_parameter_names(self) -> list[str]:
        """Parameters both parties hold (the tied word embedding of a two-way cut)."""
        return [] if self.is_u_shape else ["transformer.wte.weight"]

    def describe(self) -> str:
        return " | ".join(s.describe(self.num_layers) for s in self.stages)

    def to_dict(self) -> dict:
        return {"num_layers": self.num_layers, "front": self.front, "back": self.back}

    @classmethod
    def from_dict(cls, d: dict) -> Partition:
        try:
            return cls(int(d["num_layers"]), int(d["front"]), d.get("back"))
        except (KeyError, TypeError) as e:
            raise PartitionError(f"bad partition record {d!r} ({e})") from None


_SPEC = re.compile(r"^(?:u:(\d+),(\d+)|two-way:(\d+))$")


def parse_partition(spec: str, cfg: PanguConfig) -> Partition:
    """``u:F,K`` (U-shape) or ``two-way:F`` for a model of ``cfg``'s depth."""
    m = _SPEC.match(spec.strip())
    if not m:
        raise PartitionError(
            f"cut {spec!r}: expected 'u:FRONT,BACK' (e.g. u:1,1) or 'two-way:FRONT'"
        )
    if m.group(3) is not None:
        return Partition(cfg.num_layers, int(m.group(3)), None)
    return Partition(cfg.num_layers, int(m.group(1)), int(m.group(2)))


def check_party(party: str) -> None:
    if party not in PARTIES:
        raise PartitionError(f"unknown party {party!r} (known: {', '.join(PARTIES)})")


def build_party_model(
    cfg: PanguConfig,
    partition: Partition,
    party: str,
    *,
    seed: int | None = None,
    seeds: dict[str, int] | None = None,
    device: str | torch.device = "cpu",
) -> PanguAlpha:
    """The model with only ``party``'s modules materialised, the rest on meta.

    Each parameter is initialised exactly as ``build_model(cfg, seed=seed)``
    would (per-parameter seeded init), so a split run starts from the same
    weights as the unsplit one without ever allocating the other party's part.
    A party that must not know the run's seed gets ``seeds`` instead: the
    per-parameter seeds of exactly its own parameters (``init_seeds``).
    """
    if partition.num_layers != cfg.num_layers:
        raise PartitionError(
            f"partition {partition.spec} is for {partition.num_layers} layers, the "
            f"model has {cfg.num_layers}"
        )
    if (seed is None) == (seeds is None):
        raise TypeError("build_party_model takes either seed or seeds")
    model = build_model(cfg, device="meta")
    for path in partition.module_paths(party):
        model.get_submodule(path).to_empty(device=device)
    if "transformer.wte" in partition.module_paths(party):
        # to_empty replaced wte.weight; lm_head still points at the meta one.
        model.tie_weights()
    own = partition.parameter_names(model, party)
    if seeds is not None:
        if set(seeds) != set(own):
            missing = sorted(set(own) - set(seeds))
            extra = sorted(set(seeds) - set(own))
            raise PartitionError(
                f"init seeds are not party {party}'s parameters (missing "
                f"{missing[:3]}, unexpected {extra[:3]})"
            )
        model.reset_parameters(seeds=seeds)
    else:
        model.reset_parameters(seed, names=own)
    return model


def init_seeds(
    cfg: PanguConfig, partition: Partition, party: str, seed: int
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
    cfg: PanguConfig, partition: Partition, party: str
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
    states (B, T, C) -- after the top query layer for a head stage (apply
    ``logits`` for the vocabulary). The ops are exactly those of
    ``PanguAlpha.hidden``, so chaining the stages reproduces the unsplit model.
    The model is held by reference, not registered, so parameter names stay
    the model's own.
    """

    def __init__(self, model: PanguAlpha, stage: Stage) -> None:
        super().__init__()
        self._model = (model,)
        self.stage = stage

    @property
    def model(self) -> PanguAlpha:
        return self._model[0]

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: StageCache | None = None,
    ) -> torch.Tensor:
        """With ``cache`` (``new_cache``), ``x`` holds only the positions after
        the cached ones, run exactly as ``PanguAlpha.hidden(..., cache=...)``
        runs them; the cache grows by them."""
        if cache is not None:
            return self._forward_cached(x, cache)
        m = self.model
        if self.stage.embed:
            x = m.embed(x, position_ids)
        for i in self.stage.blocks:
            x = m.transformer.h[i](x, attn_mask)
        if self.stage.head:
            x = m.top_query(x, attn_mask, position_ids)
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
        kvs = iter(cache.layers)
        if self.stage.embed:
            x = m.embed(x, positions)
        for i in self.stage.blocks:
            x = m.transformer.h[i](x, kv=next(kvs))
        if self.stage.head:
            x = m.top_query(x, position_ids=positions, kv=next(kvs))
        cache.length = start + T
        return x

    def new_cache(self, capacity: int, batch_size: int = 1) -> StageCache:
        """An empty ``StageCache`` for this stage's layers, on the device and in
        the dtype of its weights, for up to ``capacity`` positions (at most
        ``seq_len``: positions beyond have no learned embedding)."""
        cfg = self.model.config
        if not 1 <= capacity <= cfg.seq_len:
            raise ValueError(
                f"KV cache capacity must be in 1..{cfg.seq_len} (the model's "
                f"seq_len), got {capacity}"
            )
        layers = [self.model.transformer.h[i] for i in self.stage.blocks]
        if self.stage.head:
            layers.append(self.model.transformer.h[cfg.num_layers - 1])
        shape = (batch_size, cfg.num_heads, capacity, cfg.head_dim)
        kvs = []
        for layer in layers:
            w = layer.attn.k_proj.weight
            kvs.append(
                LayerKV(
                    torch.empty(shape, device=w.device, dtype=w.dtype),
                    torch.empty(shape, device=w.device, dtype=w.dtype),
                )
            )
        return StageCache(kvs, capacity)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.stage.head:
            raise RuntimeError("logits() needs the head stage")
        return self.model.logits(hidden)

    def extra_repr(self) -> str:
        return self.stage.describe(self.model.config.num_layers)


def segments_of(
    model: PanguAlpha, partition: Partition, party: str
) -> tuple[Segment, ...]:
    return tuple(Segment(model, s) for s in partition.stages_of(party))


def parameter_count(named: Iterable[tuple[str, nn.Parameter]]) -> int:
    return sum(p.numel() for _, p in named)
