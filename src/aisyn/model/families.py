"""Which model family a config names, and how to build it.

A model config is a ``PanguConfig`` (PanGu-α, ``pangu.py``) or an
``HFConfig`` (GPT-2 in ``gpt2.py``, Llama and Qwen2 in ``llama.py``; the
config in ``hf.py``); ``MODEL_CLASSES`` is the one table of which class runs
which family. As a dict (a run's ``config.json``) it carries a ``family`` key;
PanGu-α's dicts, written before other families existed, carry none. Everything
above the model layer names configs and models through this module, never
through a family's own module, so adding a family touches only ``model/``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TypeAlias

import torch
from torch.overrides import TorchFunctionMode

from aisyn.model.capacity import check_buildable
from aisyn.model.causal_lm import CausalLM
from aisyn.model.gpt2 import GPT2
from aisyn.model.hf import FAMILIES as HF_FAMILIES
from aisyn.model.hf import HF_CONFIGS, HF_PREFIX, HFConfig, read_hf_config
from aisyn.model.llama import Llama
from aisyn.model.pangu import CONFIGS, PanguAlpha, PanguConfig
from aisyn.validate import read_json

ModelConfig: TypeAlias = PanguConfig | HFConfig
PRESETS: dict[str, dict] = {**CONFIGS, **HF_CONFIGS}
#: the model class of each family a config may name
MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "pangu": PanguAlpha,
    "gpt2": GPT2,
    "llama": Llama,
    "qwen2": Llama,  # Llama with q/k/v biases
}


def preset_fields(name: str) -> dict:
    """The config fields of preset ``name`` (a copy, to extend or override)."""
    return dict(PRESETS[name])


def config_from_dict(d: dict) -> ModelConfig:
    """A model config from its dict; ``family`` picks the kind (default pangu)."""
    if not isinstance(d, dict):
        raise ValueError("a model config must be a JSON object")
    family = d.get("family", "pangu")
    if family == "pangu":
        return PanguConfig.from_dict({k: v for k, v in d.items() if k != "family"})
    if family in HF_FAMILIES:
        return HFConfig.from_dict(d)
    raise ValueError(
        f"model family {family!r} is not supported; supported: pangu, "
        f"{', '.join(HF_FAMILIES)}"
    )


def hf_folder(name: str | Path) -> Path | None:
    """The folder of an ``hf:DIR`` model name, else None."""
    s = str(name)
    return Path(s[len(HF_PREFIX) :]) if s.startswith(HF_PREFIX) else None


def load_config(name_or_path: str | Path, **overrides) -> ModelConfig:
    """A preset name (``PRESETS``), ``hf:DIR`` (a Hugging Face model folder's
    ``config.json``) or a JSON file of config fields (a run's ``config.json``
    nests them under ``model``)."""
    name = str(name_or_path)
    if name in PRESETS:
        return config_from_dict({**PRESETS[name], **overrides})
    folder = hf_folder(name)
    if folder is not None:
        cfg = read_hf_config(folder)
        return replace(cfg, **overrides) if overrides else cfg
    path = Path(name)
    if not path.is_file():
        raise ValueError(
            f"model config {name!r} is neither a preset ({', '.join(PRESETS)}), "
            "nor hf:DIR (a Hugging Face model folder), nor an existing JSON file"
        )
    d = read_json(path)
    d = d.get("model", d)
    try:
        return config_from_dict({**d, **overrides})
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None


# torch.nn's default initialisers, which the modules' constructors call.
_INIT_OPS = frozenset(
    {"normal_", "uniform_", "fill_", "zero_", "kaiming_uniform_", "trunc_normal_"}
)


class _SkipMetaInit(TorchFunctionMode):
    """Skip in-place initialisation of meta tensors (there are no values to
    set). Not skipped, torch runs them through its reference implementations,
    whose first use imports ``torch._dynamo``: 2 s of every command's start."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _INIT_OPS:
            # torch.nn.init passes the tensor by keyword, Tensor methods as self
            t = args[0] if args else kwargs.get("tensor")
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    return MODEL_CLASSES[cfg.family]


def build_model(
    config: ModelConfig | str,
    *,
    device: str | torch.device | None = None,
    seed: int | None = None,
) -> CausalLM:
    """Build a model; ``device="meta"`` sizes any preset without allocating it."""
    cfg = load_config(config) if isinstance(config, str) else config
    cls = model_class(cfg)
    meta = device is not None and torch.device(device).type == "meta"
    check_buildable(cfg, meta=meta)  # before a module exists
    if meta:
        with torch.device("meta"), _SkipMetaInit():
            return cls(cfg)
    model = cls(cfg, seed=seed or 0)
    return model.to(device) if device is not None else model


def with_vocab(cfg: ModelConfig, vocab_size: int) -> ModelConfig:
    return replace(cfg, vocab_size=vocab_size)
