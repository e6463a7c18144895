"""The models a run reads: a config fitted to its data, weights from a run
folder, a checkpoint or a Hugging Face folder, and the base model a
fine-tuning, federated or split run starts from (``BaseModel``)."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from aisyn.data.sft import SFTData
from aisyn.data.tokenizer import HF_TOKENIZER_FILE
from aisyn.model.causal_lm import CausalLM
from aisyn.model.families import (
    ModelConfig,
    build_model,
    config_from_dict,
    hf_folder,
    load_config,
    with_vocab,
)
from aisyn.model.hf import HF_PREFIX, read_hf_folder
from aisyn.train import checkpoint as ckpt
from aisyn.train.run import TOKENIZER, RunDir

log = logging.getLogger("aisyn.train")


def model_config_for(
    model: ModelConfig | str | Path,
    tokenizer: dict,
    data_seq_len: int,
    data: str | Path | Sequence[str | Path] | None = None,
) -> ModelConfig:
    """The model config with the vocabulary of the data's tokenizer (so that
    ``aisyn train`` and ``aisyn split train`` build the same model); ValueError
    if the data's samples are longer than its positions.

    A pretrained model (``hf:DIR``) keeps its vocabulary: its embedding rows
    are fixed, so the data's tokenizer must fit in them, and be the folder's
    own ``tokenizer.json`` when it has one (``check_hf_tokenizer``; ``data``:
    the data folders, named in the refusal).
    """
    mcfg = load_config(model) if isinstance(model, str | Path) else model
    folder = hf_folder(model) if isinstance(model, str | Path) else None
    if folder is not None:
        if data is not None and not isinstance(data, str | Path):
            data = ", ".join(map(str, data))
        check_hf_tokenizer(folder, tokenizer, data)
        if tokenizer["vocab_size"] > mcfg.vocab_size:
            raise ValueError(
                f"the data's tokenizer has {tokenizer['vocab_size']} pieces, the "
                f"model {model} embeds {mcfg.vocab_size}: prepare the data with "
                "the model's own tokenizer"
            )
    elif mcfg.vocab_size != tokenizer["vocab_size"]:
        log.info(
            "model vocab_size %d -> %d (the tokenizer's)",
            mcfg.vocab_size,
            tokenizer["vocab_size"],
        )
        mcfg = with_vocab(mcfg, tokenizer["vocab_size"])
    if data_seq_len > mcfg.seq_len:
        raise ValueError(
            f"data seq_len {data_seq_len} exceeds the model's {mcfg.seq_len}"
        )
    return mcfg


def load_model_checkpoint(model: nn.Module, path: str | Path) -> Path:
    """Load weights from a run folder (its latest checkpoint), a checkpoint folder,
    a ``.safetensors`` file or ``hf:DIR`` (a Hugging Face model folder);
    returns the file or folder read."""
    folder = hf_folder(path)
    if folder is not None:
        cfg, tensors = read_hf_folder(folder)
        if cfg != model.config:
            raise ValueError(f"{folder}: its config.json is not this model's")
        ckpt.load_weights(model, tensors, str(folder))
        return folder
    path = ckpt.model_file(path)
    ckpt.load_weights(model, ckpt.read_tensors(path), str(path))
    return path


def load_run_model(
    run: str | Path, device: str | torch.device = "cpu"
) -> tuple[CausalLM, dict]:
    """The model of a run folder at its latest checkpoint, and the run's config."""
    run_dir = RunDir(run)
    config = run_dir.read_config()
    try:
        mcfg = config_from_dict(config["model"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"{run_dir.path}/config.json: bad model config ({e})"
        ) from None
    # Built on meta, then filled: a random init of weights about to be
    # overwritten would cost more than reading them (5 s of 6.5 s at 350M).
    model = build_model(mcfg, device="meta")
    load_model_checkpoint(model, run_dir.path)
    return model.to(device).eval(), config


# --- the base model of a fine-tuning, federated or split run ----------------------


@dataclass(frozen=True)
class BaseModel:
    """The pre-trained model a run starts from.

    ``checkpoint`` is the model.safetensors read; ``fingerprint`` identifies it
    to a peer (the federated server announces the file's; a split run's data
    party sends that of the tensors both parties hold, ``split.party``).
    A base found in a run folder also brings what it was made with: its
    ``path``, ``model`` config and ``tokenizer`` (sha256, vocab_size, eod_id,
    pad_id); a bare .safetensors file has none of them.
    """

    checkpoint: Path
    fingerprint: str
    path: Path | None = None
    model: ModelConfig | None = None
    tokenizer: dict | None = None

    def to_dict(self) -> dict:
        return {
            "path": str(self.path),
            "checkpoint": str(self.checkpoint),
            "fingerprint": self.fingerprint,
        }


def describe_base(base: str | Path) -> BaseModel:
    """Read a base run folder's config and locate its latest weights."""
    run = RunDir(base)
    config = run.read_config()
    try:
        mcfg = config_from_dict(config["model"])
        tok = dict(config["tokenizer"])
        if "sha256" not in tok:
            raise KeyError("tokenizer.sha256")
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{run.path}/config.json: not a model run ({e})") from None
    last = ckpt.latest(run.checkpoints)
    if last is None:
        raise ckpt.CheckpointError(f"{run.path}: base run has no checkpoint yet")
    weights = last / ckpt.MODEL_FILE
    if not weights.is_file():
        raise ckpt.CheckpointError(f"{weights}: missing")
    return BaseModel(weights, ckpt.file_fingerprint(weights), run.path, mcfg, tok)


def load_base(
    base: BaseModel | str | Path, device: str | torch.device = "cpu"
) -> tuple[CausalLM, BaseModel]:
    """The base model's weights, without a wasted random init (meta, then load)."""
    info = base if isinstance(base, BaseModel) else describe_base(base)
    model = build_model(info.model, device="meta")
    ckpt.load_weights(model, ckpt.read_tensors(info.checkpoint), str(info.checkpoint))
    return model.to(device).train(), info


def check_tokenizer(
    data_dir: Path, data_sha: str, base: str | Path, base_sha: str, run: Path
) -> None:
    """Refuse data prepared with another tokenizer than the base model's (the
    tokenizer of the base's run folder ``run``, or ``hf:DIR``'s tokenizer.json).

    The one place every command that pairs a model with data checks their
    tokenizers (``finetune``, federated runs, ``train`` and ``split train``
    with ``--model hf:DIR`` or ``--init-from``): a mismatch trains without an
    error on ids that mean other pieces to the model.
    """
    if data_sha != base_sha:
        hf = hf_folder(run) is not None
        tokenizer = run if hf else run / TOKENIZER
        prepare = "aisyn prepare" if hf else "aisyn prepare-sft"
        raise ValueError(
            f"{data_dir}: prepared with tokenizer {data_sha[:12]}, but the base "
            f"model {base} uses {base_sha[:12]}; re-run `{prepare} "
            f"--tokenizer {tokenizer}`"
        )


def check_hf_tokenizer(folder: Path, tokenizer: dict, data_dir=None) -> None:
    """Refuse data whose tokenizer is not the Hugging Face folder's own
    ``tokenizer.json`` (``check_tokenizer``); a folder without one cannot be
    checked, and a warning says so (only the vocabulary size is then)."""
    what = "the data" if data_dir is None else str(data_dir)
    file = folder / HF_TOKENIZER_FILE
    if not file.is_file():
        log.warning(
            "%s has no %s, so the tokenizer of %s cannot be checked against the "
            "model's (only the vocabulary size is): make sure the data was "
            "prepared with the model's own tokenizer",
            folder,
            HF_TOKENIZER_FILE,
            what,
        )
        return
    theirs = hashlib.sha256(file.read_bytes()).hexdigest()
    name = f"{HF_PREFIX}{folder}"
    check_tokenizer(what, tokenizer["sha256"], name, theirs, name)


def check_data_matches(info: BaseModel, data: Sequence[SFTData]) -> None:
    for d in data:
        check_tokenizer(
            d.data_dir,
            d.tokenizer_info["sha256"],
            info.path,
            info.tokenizer["sha256"],
            info.path,
        )
        if d.seq_len > info.model.seq_len:
            raise ValueError(
                f"{d.data_dir}: sequences of {d.seq_len} tokens exceed the base "
                f"model's seq_len {info.model.seq_len}"
            )


def check_base_tokenizer(base: str | Path, tokenizer: dict, data_dir) -> None:
    """Refuse SFT data made with another tokenizer than the base model's.

    The base's tokenizer is in its run folder's config.json (a run folder, one
    of its checkpoint folders, or the model file in one); a bare .safetensors
    file has none, and then only the vocabulary size is checked (by the shape
    of the embedding, when the base is read).
    """
    if (folder := hf_folder(base)) is not None:
        check_hf_tokenizer(folder, tokenizer, data_dir)
        return
    file = ckpt.model_file(base)
    if not file.is_file():
        return  # reading the base says so, in one line
    run_configs = [Path(base) / "config.json"]
    if file.parent.parent.name == "checkpoints":  # run/checkpoints/step_N/
        run_configs.append(file.parent.parent.parent / "config.json")
    config = next((c for c in run_configs if c.is_file()), None)
    if config is None:
        log.warning(
            "%s: no run folder around the base model, so the tokenizer of %s cannot "
            "be checked against it (only the vocabulary size is)",
            base,
            data_dir,
        )
        return
    theirs = RunDir(config.parent).read_config().get("tokenizer", {}).get("sha256")
    if theirs is not None:
        check_tokenizer(data_dir, tokenizer["sha256"], base, theirs, config.parent)
