"""``aisyn split merge``: both halves of a split run -> one ordinary run folder.

For release, once both parties agree to hand their checkpoints over. The
result is what ``aisyn train`` writes (``"kind": "train"``, one
``model.safetensors`` with every weight, AdamW moments keyed by name, the data
party's sampler state), so ``aisyn eval``, ``load_run_model`` and even
``aisyn train --resume`` treat it as a plain run. Both halves must come from
the same run (run id), the same step, and together cover the model exactly.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from aisyn.model.families import ModelConfig, build_model, config_from_dict
from aisyn.model.segments import (
    COMPUTE_PARTY,
    DATA_PARTY,
    Partition,
    own_tensor_shapes,
)
from aisyn.split.backbone import shards
from aisyn.split.party import run_methods
from aisyn.train import checkpoint as ckpt
from aisyn.train.lora import ADAPTER_NAME, Method
from aisyn.train.run import METRICS, TOKENIZER, RunDir
from aisyn.validate import name_differences

log = logging.getLogger(__name__)


class MergeError(ValueError):
    """The two halves do not belong together."""


def find_compute_run(data_config: dict, compute: Path) -> RunDir:
    """``compute`` is B's run folder, or the ``--out`` root B served from."""
    run_id = data_config["run_id"]
    for candidate in (compute, compute / run_id):
        cfg_path = candidate / "config.json"
        if cfg_path.is_file():
            config = RunDir(candidate).read_config()
            if config.get("kind") == "split-compute":
                if config.get("run_id") != run_id:
                    raise MergeError(
                        f"{candidate}: compute half of run {config.get('run_id')}, "
                        f"the data half is run {run_id}"
                    )
                return RunDir(candidate)
    raise MergeError(f"{compute}: holds no compute-party folder of run {run_id}")


def merge(
    data_run: str | Path,
    compute_run: str | Path,
    out: str | Path,
    *,
    step: int | None = None,
) -> Path:
    """Write the merged run to ``out`` (which must not hold a run); returns the
    checkpoint folder written."""
    a_run = RunDir(data_run)
    a_cfg = a_run.read_config()
    if a_cfg.get("kind") != "split":
        raise MergeError(f"{a_run.path}: not the data party's folder of a split run")
    b_run = find_compute_run(a_cfg, Path(compute_run))
    b_cfg = b_run.read_config()
    for key in ("model", "partition"):
        if a_cfg[key] != b_cfg.get(key):
            raise MergeError(f"{b_run.path}: {key} differs from {a_run.path}'s")
    a_steps = ckpt.complete_steps(a_run.checkpoints)
    b_steps = shards.complete_steps(b_run.checkpoints)
    common = sorted(set(a_steps) & set(b_steps))
    if step is None:
        if not common:
            raise MergeError(
                f"no step checkpointed by both parties (data {a_steps or 'none'}, "
                f"compute {b_steps or 'none'})"
            )
        step = common[-1]
    elif step not in common:
        raise MergeError(
            f"step {step} is not checkpointed by both parties (both have "
            f"{common or 'none'})"
        )
    a_dir = ckpt.step_folder(a_run.checkpoints, step)
    b_dir = ckpt.step_folder(b_run.checkpoints, step)
    mcfg = config_from_dict(a_cfg["model"])
    partition = Partition.from_dict(a_cfg["partition"], mcfg.layout)
    a_method = run_methods(a_cfg)[0]
    b_lora = b_cfg.get("lora")
    b_method = Method("lora", **b_lora) if b_lora else Method()
    halves = {
        DATA_PARTY: (a_dir, a_method, a_cfg.get("init_from")),
        COMPUTE_PARTY: (b_dir, b_method, b_cfg.get("init_from")),
    }
    files = {}
    for name in (ckpt.MODEL_FILE, ckpt.OPTIM_FILE):
        half = {}
        for party, (folder, method, base) in halves.items():
            if party == COMPUTE_PARTY:  # the union of its ranks' shares
                t = shards.read_share(folder, name, lambda _name: True)
            else:
                t = ckpt.read_tensors(folder / name)
            if name == ckpt.MODEL_FILE:
                t = plain_weights(mcfg, partition, party, t, method, base, folder)
            elif method.name == "lora":  # adapters' moments fit no plain weight
                t = {k: v for k, v in t.items() if k.startswith("rng.")}
            half[party] = t
        a_t, b_t = half[DATA_PARTY], half[COMPUTE_PARTY]
        if name == ckpt.OPTIM_FILE:  # RNG states are per party; keep A's
            b_t = {k: v for k, v in b_t.items() if not k.startswith("rng.")}
        both = sorted(set(a_t) & set(b_t))
        if both:
            raise MergeError(f"{name}: both halves hold {both[:3]}")
        files[name] = {**a_t, **b_t}
    _check_complete(mcfg, files[ckpt.MODEL_FILE])

    out_run = RunDir(out)
    config = {
        "kind": "train",
        "model": a_cfg["model"],
        "train": a_cfg["train"],
        "data": a_cfg["data"],
        "tokenizer": a_cfg["tokenizer"],
        "seq_len": a_cfg["seq_len"],
        "init_from": None,
        "merged_from": {
            "data_party": str(a_run.path.resolve()),
            "compute_party": str(b_run.path.resolve()),
            "run_id": a_cfg["run_id"],
            "step": step,
            "partition": a_cfg["partition"],
        },
    }
    out_run.create(config, resume=False)
    shutil.copyfile(a_run.path / TOKENIZER, out_run.path / TOKENIZER)
    if (a_run.path / METRICS).is_file():
        shutil.copyfile(a_run.path / METRICS, out_run.path / METRICS)
    state = ckpt.read_state(a_dir)
    state.pop("party", None)
    state.pop("partition", None)
    folder = ckpt.save(out_run.checkpoints, step, files, state, keep=1)
    out_run.plot()
    log.info("merged step %d of run %s into %s", step, a_cfg["run_id"], folder)
    return folder


def plain_weights(
    cfg: ModelConfig,
    partition: Partition,
    party: str,
    tensors: dict[str, torch.Tensor],
    method: Method,
    base: str | None,
    source: Path,
) -> dict[str, torch.Tensor]:
    """A half's weights as plain tensors: a LoRA half's checkpoint holds its
    adapters only, so its base tensors get ``W + alpha / rank * B @ A``."""
    if method.name != "lora":
        return tensors
    if not base:
        raise MergeError(f"{source}: LoRA adapters, but the run records no base")
    plain = ckpt.read_some_tensors(
        ckpt.model_file(base),
        own_tensor_shapes(cfg, partition, party),
        f"party {party} needs to merge its adapters",
    )
    suffix = f".lora_A.{ADAPTER_NAME}.weight"
    modules = [n[: -len(suffix)] for n in tensors if n.endswith(suffix)]
    expected = {f"{m}.lora_{x}.{ADAPTER_NAME}.weight" for m in modules for x in "AB"}
    if not modules or set(tensors) != expected:
        raise MergeError(f"{source}: not a set of LoRA adapters")
    scale = method.alpha / method.rank
    for m in modules:
        a = tensors[f"{m}.lora_A.{ADAPTER_NAME}.weight"].float()
        b = tensors[f"{m}.lora_B.{ADAPTER_NAME}.weight"].float()
        w = plain.get(f"{m}.weight")
        if w is None or tuple(w.shape) != (b.shape[0], a.shape[1]):
            raise MergeError(f"{source}: adapters of {m} fit no base weight")
        plain[f"{m}.weight"] = (w.float() + scale * (b @ a)).to(w.dtype)
    return plain


def _check_complete(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    model = build_model(cfg, device="meta")
    # named_parameters lists the tied head once, as transformer.wte.weight.
    expected = dict(model.named_parameters()) | dict(model.named_buffers())
    if diff := name_differences(expected, tensors):
        raise MergeError(f"the two halves do not make up the model ({diff})")
    for name, t in expected.items():
        if tuple(tensors[name].shape) != tuple(t.shape):
            raise MergeError(f"{name}: shape {tuple(tensors[name].shape)}")
