"""Whether a model config can be built here, decided before anything is built.

A config names sizes; a file from elsewhere can name any. Building what it
names allocates the weights (``num_layers`` 10⁷ of a small block: GBs) and,
even on the meta device, one Python module per layer (about 30 KB and 1 ms
each: 10⁶ layers are half an hour and 30 GB before the first step). So the
sizes are weighed first, by arithmetic (``parameter_count``), and refused in
one line naming the field when they cannot be what a real model is or cannot
fit in the memory that is free. The free memory is what the OS (or the
cgroup the process runs in) or CUDA says; ``train.memory`` uses it for its
training estimate too.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

SKIP_ENV = "AISYN_SKIP_MEMORY_CHECK"

#: More blocks than any published model has (Llama 3.1 405B: 126) by far.
MAX_LAYERS = 4096
#: A dimension beyond int32 is no model's, and products of two would overflow
#: the 64-bit element counts torch keeps even for meta tensors.
MAX_DIM = 2**31 - 1
_DIMS = ("vocab_size", "hidden_size", "num_heads", "head_dim", "ffn_size", "seq_len")
#: 5 000 times the largest preset (200B); also keeps every tensor's element
#: count, which the total bounds, far inside int64.
MAX_PARAMETERS = 2**50


def _meminfo_available() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


#: (limit, usage, stat file, its page-cache key) of cgroup v2, then v1
_CGROUP_FILES = (
    ("memory.max", "memory.current", "memory.stat", "file"),
    (
        "memory/memory.limit_in_bytes",
        "memory/memory.usage_in_bytes",
        "memory/memory.stat",
        "total_cache",
    ),
)


def cgroup_available(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """Room left under this process's cgroup memory limit; None without one.

    Usage counts the page cache, which the kernel drops before it kills
    anything, so it is left out (as MemAvailable leaves it out).
    """
    for limit_file, usage_file, stat_file, cache_key in _CGROUP_FILES:
        try:
            limit_text = (root / limit_file).read_text().strip()
            if limit_text == "max":  # v2: no limit
                return None
            limit = float(limit_text)
            if limit >= 2**60:  # v1: no limit
                return None
            usage = float((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        cache = 0.0
        try:
            for line in (root / stat_file).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == cache_key:
                    cache = float(value)
        except (OSError, ValueError):
            pass
        return max(0.0, limit - max(0.0, usage - cache))
    return None


def available_bytes(device: torch.device) -> float | None:
    """Free memory for a run on ``device``; None where it cannot be told."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return float(free)
    if device.type != "cpu":
        return None
    known = [b for b in (_meminfo_available(), cgroup_available()) if b is not None]
    return min(known) if known else None


def memory_check_skipped() -> bool:
    return os.environ.get(SKIP_ENV, "") not in ("", "0")


def _largest_term(cfg) -> str:
    """The field whose term dominates the parameter count: what to lower."""
    h = cfg.hidden_size
    terms = {
        "num_layers": cfg.num_layers * (h * h + h * cfg.ffn_size),
        "vocab_size": cfg.vocab_size * h,
        "seq_len": cfg.seq_len * h if cfg.family in ("pangu", "gpt2") else 0,
    }
    return max(terms, key=terms.get)


def check_buildable(cfg, *, meta: bool) -> None:
    """``ValueError`` in one line naming the field unless a model of ``cfg``
    can be built: every size within what a model can be, and, unless built
    on the meta device (which allocates no weights), its fp32 weights within
    the memory free here (``AISYN_SKIP_MEMORY_CHECK=1`` skips that part)."""
    for name in _DIMS:
        value = getattr(cfg, name)
        if value > MAX_DIM:
            raise ValueError(
                f"{name} {value} is larger than any model's ({MAX_DIM} at most)"
            )
    if cfg.num_layers > MAX_LAYERS:
        raise ValueError(
            f"num_layers {cfg.num_layers} is more than any model has "
            f"({MAX_LAYERS} at most); building them would take minutes and GBs "
            "before anything runs"
        )
    params = cfg.parameter_count()
    if params > MAX_PARAMETERS:
        field = _largest_term(cfg)
        raise ValueError(
            f"a model of {params:.3g} parameters is larger than any "
            f"({MAX_PARAMETERS:.3g} at most); lower {field} ({getattr(cfg, field)})"
        )
    if meta or memory_check_skipped():
        return
    needed = params * torch.empty((), dtype=torch.get_default_dtype()).element_size()
    free = available_bytes(torch.device("cpu"))
    if free is None or needed <= free:
        return
    from aisyn.model.cost import format_bytes

    field = _largest_term(cfg)
    raise ValueError(
        f"a model of {params:,} parameters needs {format_bytes(needed)} for its "
        f"weights alone, but only {format_bytes(free)} is free; lower {field} "
        f"({getattr(cfg, field)}), or set {SKIP_ENV}=1 to try anyway"
    )


def check_against_weights(
    cfg, shapes: dict[str, tuple[int, ...]], source: str, layers_field: str
) -> None:
    """``ValueError`` in one line unless the sizes ``cfg`` declares are those
    of the stored tensors ``shapes`` (ours: name -> shape, read from the
    files' headers): as many blocks as the weights hold, and the embedding,
    head and first block shaped as the config makes them. Checked before the
    model is built, so a config.json that declares 10⁹ layers (or 30 000
    positions) beside small weights is refused instead of built; the loader
    then checks every tensor by name."""
    from dataclasses import replace

    from aisyn.model.families import build_model

    lay = cfg.layout
    prefix = re.escape(lay.block.partition("{i}")[0])
    pattern = re.compile(prefix + r"(\d+)\.")
    held = {int(m.group(1)) for n in shapes if (m := pattern.match(n))}
    if len(held) != cfg.num_layers:
        raise ValueError(
            f"{source}: config.json says {layers_field} {cfg.num_layers}, but the "
            f"weights hold {len(held)} layers"
        )
    # A model of at most two layers has every kind of tensor the config sizes
    # (embeddings, a block, the head) at the config's sizes.
    small = build_model(replace(cfg, num_layers=min(cfg.num_layers, 2)), device="meta")
    first = lay.block_path(0) + "."
    other_blocks = re.compile(prefix + r"(?!0\.)\d+\.")
    for name, p in small.named_parameters():
        if other_blocks.match(name) or name not in shapes:
            continue  # a later block is shaped as the first; the loader checks
        if tuple(shapes[name]) != tuple(p.shape):
            where = "the first block's " if name.startswith(first) else ""
            raise ValueError(
                f"{source}: config.json does not describe the weights: {where}"
                f"{name} is {tuple(shapes[name])} in the file, the config makes it "
                f"{tuple(p.shape)}"
            )
