"""LoRA adapters through ``peft``, and what a fine-tuning run trains.

``peft.inject_adapter_in_model`` replaces the attention and MLP ``nn.Linear``
modules of every block, matched by name, with LoRA layers in place; the base
weights are frozen. Which modules those are is the model family's to say
(``config.lora_targets``: PanGu-α's ``q/k/v/c_proj`` and ``c_fc``, Llama's
``q/k/v/o_proj`` and ``gate/up/down_proj``, GPT-2's ``c_attn``, ``c_proj``,
``c_fc``). Whatever the method, the *trainable tensors* are named exactly as in
``model.named_parameters()``: all parameters for full fine-tuning, only
``...lora_A.default.weight`` / ``...lora_B.default.weight`` for LoRA. Those, and
nothing else, are what a federated client sends.

Checkpoints are always written as plain PanGu-α weights (adapters merged:
``W + scale * B @ A``), so ``aisyn eval`` and ``load_run_model`` read them like any
other run.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from aisyn.model.causal_lm import parameter_seed
from aisyn.train.checkpoint import unique_state_dict

ADAPTER_NAME = "default"
METHODS = ("full", "lora")


@dataclass
class Method:
    """Full fine-tuning, or LoRA of a given rank on the named Linear modules
    (none named: the model family's ``lora_targets``)."""

    name: str = "full"
    rank: int = 8
    alpha: float = 16.0
    targets: Sequence[str] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.name not in METHODS:
            raise ValueError(f"unknown method {self.name!r}; expected one of {METHODS}")
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        self.targets = tuple(self.targets)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["targets"] = list(self.targets)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Method:
        return cls(**d)


def lora_parameter_names(
    model: nn.Module, method: Method, within: Iterable[str] | None = None
) -> list[str]:
    """The names the LoRA tensors of ``method`` will have on ``model`` (a meta
    model will do), limited to the submodules ``within`` (module paths)."""
    targets = set(method.targets or model.config.lora_targets)
    prefixes = None if within is None else tuple(p + "." for p in within)
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or name.rsplit(".", 1)[-1] not in targets:
            continue
        if prefixes is not None and not name.startswith(prefixes):
            continue
        names += [
            f"{name}.lora_A.{ADAPTER_NAME}.weight",
            f"{name}.lora_B.{ADAPTER_NAME}.weight",
        ]
    return names


def apply_method(
    model: nn.Module,
    method: Method,
    seed: int = 0,
    *,
    within: Iterable[str] | None = None,
    seeds: dict[str, int] | None = None,
) -> list[tuple[str, nn.Parameter]]:
    """Prepare ``model`` for ``method``; returns its trainable (name, parameter)s.

    LoRA adapts the target modules inside ``within`` (module paths; default
    everywhere) and freezes every other weight. Each ``A`` matrix is drawn
    (peft's Kaiming-uniform) from its own generator, seeded by
    ``parameter_seed(seed, name)`` or by ``seeds[name]``, so a split party
    that adapts only its own blocks draws exactly what an unsplit model
    would, and a compute party is given its seeds, never ``seed``; ``B`` is
    zero, so the adapted model starts equal to the base.
    """
    if method.name == "full":
        for p in model.parameters():
            p.requires_grad_(True)
        return list(model.named_parameters())
    from peft import LoraConfig, inject_adapter_in_model

    names = lora_parameter_names(model, method, within)
    if not names:
        raise ValueError("LoRA: no module to adapt in this part of the model")
    modules = sorted({n.rsplit(".lora_", 1)[0] for n in names})
    config = LoraConfig(
        r=method.rank,
        lora_alpha=method.alpha,
        # exactly these modules (a regex is matched against whole names)
        target_modules="|".join(re.escape(m) for m in modules),
        lora_dropout=0.0,
        bias="none",
    )
    # peft draws A with the global RNG; fork it so the caller's stream is
    # untouched (the draws are replaced below anyway).
    with torch.random.fork_rng(devices=[]):
        inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if sorted(n for n, _ in trainable) != sorted(names):
        raise RuntimeError(f"LoRA left unexpected trainable tensors: {trainable[:3]}")
    with torch.no_grad():
        for name, p in trainable:
            if ".lora_A." in name:
                g = torch.Generator(device=p.device)
                g.manual_seed(seeds[name] if seeds else parameter_seed(seed, name))
                nn.init.kaiming_uniform_(p, a=math.sqrt(5), generator=g)
    return trainable


def trainable_tensors(
    trainable: Sequence[tuple[str, nn.Parameter]],
) -> dict[str, torch.Tensor]:
    """Detached fp32 CPU copies of the trainable tensors, by name."""
    return {n: p.detach().float().cpu().clone() for n, p in trainable}


@torch.no_grad()
def load_trainable(
    trainable: Sequence[tuple[str, nn.Parameter]], tensors: dict[str, torch.Tensor]
) -> None:
    """Copy ``tensors`` (validated beforehand) into the trainable parameters."""
    for n, p in trainable:
        p.copy_(tensors[n])


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Plain PanGu-α weights with every LoRA adapter merged in (a copy)."""
    deltas = {}
    # Without peft imported no adapter can be present (and importing it is slow).
    if "peft" in sys.modules:
        from peft.tuners.lora import LoraLayer

        for name, module in model.named_modules():
            if isinstance(module, LoraLayer):
                deltas[f"{name}.weight"] = module.get_delta_weight(ADAPTER_NAME)
    out = {}
    for name, t in unique_state_dict(model).items():
        if ".lora_" in name:
            continue
        plain = name.replace(".base_layer.", ".")
        out[plain] = t + deltas[plain] if plain in deltas else t.clone()
    return out
