"""``aisyn convert``: PanGu-α weights between MindSpore ``.ckpt`` files and runs.

``--from mindspore FILE.ckpt [FILE2.ckpt ...] --out DIR`` writes a run folder
that every command taking a base model loads (``aisyn train --init-from``,
``aisyn finetune --base``, ``aisyn fl ... --base``): ``config.json`` with the
model config read off the tensor shapes, ``checkpoints/step_00000000/`` with
``model.safetensors``, and with ``--tokenizer`` the tokenizer. Several files
make one model (the split reference's embedding, backbone and head files;
a model-parallel run's rank files, merged from ``--strategy FILE`` or PanGu-α's
known layout, ``aisyn.model.mindspore_parallel``); optimizer and loop state in
a training checkpoint is skipped and reported. The weights' dtypes are
recorded (``source.dtype``, ``source.dtypes``) for the way back. The folder
is built beside ``--out`` and renamed into place, so a failure leaves nothing
behind.

``--from pangu-port DIR --out DIR`` does the same for a folder of the public
PyTorch port (``aisyn.model.port``; its ``vocab.model`` is the tokenizer).

``--from hf DIR --out DIR`` does the same for a Hugging Face GPT-2, Llama or
Qwen2 folder as ``save_pretrained`` writes it (``aisyn.model.hf``).

``--to mindspore --run RUN --out FILE.ckpt [--dtype fp16|bf16|fp32]`` writes a
run's latest weights under the official MindSpore model's names
(``aisyn.model.mindspore_pangu``), each tensor in the dtype the run's MindSpore
source had it in (fp32 for any other run) unless ``--dtype`` says otherwise.
``--to hf --run RUN --out DIR`` writes them as a Hugging Face folder
(``config.json`` + ``model.safetensors``): one ``transformers`` loads for a
GPT-2/Llama/Qwen2 run, the PyTorch port's layout for a PanGu-α run.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
from pathlib import Path

from aisyn.validate import positive_int

log = logging.getLogger(__name__)

SOURCES = ["mindspore", "pangu-port", "hf"]
TARGETS = ["mindspore", "hf"]
#: ``--dtype`` names <-> torch dtypes, for MindSpore exports
DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def convert_from_mindspore(
    files: list[str | Path],
    out: str | Path,
    *,
    tokenizer: str | Path | None = None,
    num_heads: int | None = None,
    strategy: str | Path | None = None,
) -> dict:
    """Read MindSpore checkpoints into a new run folder ``out``; its summary
    (``skipped``: the training-state entries left out)."""
    from aisyn.data.tokenizer import load_tokenizer
    from aisyn.model.mindspore_ckpt import read_checkpoint
    from aisyn.model.mindspore_pangu import (
        gather_weights,
        infer_config,
        is_training_state,
        saved_dtypes,
        to_state_dict,
    )
    from aisyn.model.mindspore_parallel import merge_rank_files, read_strategy

    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out}: already exists; choose another --out")
    tok = load_tokenizer(tokenizer) if tokenizer else None  # fail early
    layouts = read_strategy(strategy) if strategy else None
    undecoded: set[str] = set()  # optimizer state: parsed, never decoded

    def keep(name: str) -> bool:
        if is_training_state(name):
            undecoded.add(name)
            return False
        return True

    entries = {str(f): read_checkpoint(f, keep=keep) for f in files}
    skipped: list[str] = []
    weights = gather_weights(merge_rank_files(entries, layouts), skipped)
    skipped = sorted(undecoded | set(skipped))
    log.debug("skipped %d training-state entries: %s", len(skipped), skipped)
    cfg = infer_config(weights, num_heads)
    # what --to mindspore writes by default: each tensor as it came
    dtype, others = saved_dtypes(weights, cfg)
    state = to_state_dict(weights, cfg)
    source = {
        "format": "mindspore",
        "files": [str(Path(f)) for f in files],
        "dtype": dtype,
    }
    if others:
        source["dtypes"] = others
    if strategy:
        source["strategy"] = str(strategy)
    return {**write_base(out, cfg, state, tok, source), "skipped": skipped}


def skipped_summary(names: list[str]) -> str:
    """One line for the skipped training state: optimizer state counted by
    its prefix, the rest (loop state, metadata) by name."""
    from aisyn.model.mindspore_pangu import IGNORED_PREFIXES

    counts: dict[str, int] = {}
    rest = []
    for name in names:
        prefix = next((p for p in IGNORED_PREFIXES if name.startswith(p)), None)
        if prefix is None:
            rest.append(name)
        else:
            counts[prefix] = counts.get(prefix, 0) + 1
    parts = [f"{n} {p}*" for p, n in counts.items()]
    if rest:
        parts.append(
            ", ".join(rest[:12]) + (f" (+{len(rest) - 12})" if len(rest) > 12 else "")
        )
    return f"{len(names)} entries: " + "; ".join(parts)


def convert_from_port(
    folder: str | Path, out: str | Path, *, tokenizer: str | Path | None = None
) -> dict:
    """Read a folder of the public PyTorch port (``aisyn.model.port``) into a
    new run folder ``out``; its ``vocab.model`` is the tokenizer unless
    ``tokenizer`` is given."""
    from aisyn.model.port import read_port

    if tokenizer is None and (Path(folder) / "vocab.model").is_file():
        tokenizer = Path(folder) / "vocab.model"
    return _convert_folder(folder, out, tokenizer, read_port, "pangu-port")


def convert_from_hf(
    folder: str | Path, out: str | Path, *, tokenizer: str | Path | None = None
) -> dict:
    """Read a Hugging Face model folder (``aisyn.model.hf``) into a new run
    folder ``out``."""
    from aisyn.model.hf import read_hf_folder

    return _convert_folder(folder, out, tokenizer, read_hf_folder, "hf")


def _convert_folder(folder, out, tokenizer, read, fmt: str) -> dict:
    """A new run folder ``out`` of the (config, tensors) that ``read`` makes
    of ``folder``, checked against the model they configure."""
    from aisyn.data.tokenizer import load_tokenizer
    from aisyn.model.families import build_model
    from aisyn.train import checkpoint as ckpt

    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out}: already exists; choose another --out")
    tok = load_tokenizer(tokenizer) if tokenizer else None  # fail early
    cfg, tensors = read(folder)
    model = build_model(cfg, device="meta")
    names = ckpt.check_weights(model, tensors, str(folder))
    state = {k: tensors[k].contiguous() for k in names}
    return write_base(out, cfg, state, tok, {"format": fmt, "folder": str(folder)})


def write_base(out: Path, cfg, state: dict, tok, source: dict) -> dict:
    """A run folder holding ``state`` as step 0, built beside ``out`` and renamed
    into place (nothing is left behind on failure)."""
    from aisyn.train import checkpoint as ckpt
    from aisyn.train.run import RunDir

    # Hugging Face models may pad their embedding past the tokenizer's
    # vocabulary (Qwen2: 151936 rows for 151665 tokens); a PanGu one may not.
    padded = tok is not None and tok.info().get("kind") == "hf"
    if tok is not None and (
        tok.vocab_size > cfg.vocab_size
        or (tok.vocab_size != cfg.vocab_size and not padded)
    ):
        raise ValueError(
            f"{tok.path}: {tok.vocab_size} pieces, but the weights' word "
            f"embedding has {cfg.vocab_size} rows; the wrong tokenizer?"
        )
    config = {
        "kind": "converted",
        "model": cfg.to_dict(),
        # Without the tokenizer the model was trained with, no data can be
        # checked against it: "unknown" matches none, so finetune refuses data.
        "tokenizer": tok.info() if tok else {"sha256": "unknown"},
        "source": source,
    }
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        run = RunDir(tmp)
        run.create(config, resume=False)
        if tok is not None:
            run.copy_tokenizer(tok.path)
        ckpt.save(run.checkpoints, 0, {ckpt.MODEL_FILE: state}, {"converted": True})
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"out": str(out), "model": cfg.to_dict(), "tensors": len(state)}


def _run_weights(run: str | Path, out: Path):
    """(model config, latest weights, their file) of run folder ``run``, after
    refusing an ``out`` that exists (nothing is ever overwritten)."""
    from aisyn.model.families import config_from_dict
    from aisyn.train import checkpoint as ckpt
    from aisyn.train.run import RunDir

    if out.exists():
        raise FileExistsError(f"{out}: already exists; choose another --out")
    config = RunDir(run).read_config()
    try:
        cfg = config_from_dict(config["model"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{run}/config.json: not a model run ({e})") from None
    weights = ckpt.model_file(run)
    return cfg, ckpt.read_tensors(weights), weights


def convert_to_mindspore(
    run: str | Path, out: str | Path, *, crc: bool = False, dtype: str | None = None
) -> dict:
    """Write the latest weights of run folder ``run`` as MindSpore ``out``, in
    ``dtype`` (a ``DTYPES`` name; default: each tensor in the dtype it had in
    the MindSpore checkpoint the run was converted from, recorded in its
    config, else fp32: MindSpore's strict load wants the network's own
    dtypes). A missing parent folder of ``out`` is created."""
    from aisyn.model.mindspore_ckpt import write_checkpoint
    from aisyn.model.mindspore_pangu import DTYPE_NAMES, expected_shapes, to_mindspore
    from aisyn.train import checkpoint as ckpt

    out = Path(out)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
    cfg, state, weights = _run_weights(run, out)
    others: dict = {}
    if dtype is None:
        dtype, others = _source_dtypes(run) or ("fp32", {})
    missing = [n for n in expected_shapes(cfg) if n not in state]
    if missing:
        raise ckpt.CheckpointError(
            f"{weights}: lacks {missing[0]} ({len(missing)} tensors); a split run "
            "holds one party's half: merge it first (aisyn split merge)"
        )
    for name, shape in expected_shapes(cfg).items():
        if tuple(state[name].shape) != shape:
            raise ckpt.CheckpointError(
                f"{weights}: {name} has shape {tuple(state[name].shape)}, the run's "
                f"config says {shape}"
            )
    if getattr(cfg, "activation", "gelu") != "fast_gelu":
        # MindSpore's PanGu-α computes fast_gelu whatever the file holds
        log.warning(
            "%s: this model uses the exact GELU; MindSpore's PanGu-α computes "
            "fast_gelu, so its logits will differ slightly from this model's",
            run,
        )
    tensors = to_mindspore(
        state,
        cfg,
        DTYPE_NAMES[dtype],
        {k: DTYPE_NAMES[v] for k, v in others.items()},
    )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(f"{out}: a file is in the way of its folder") from None
    write_checkpoint(out, tensors, crc=crc)
    mixed = f" ({len(others)} kinds of tensor otherwise)" if others else ""
    return {"out": str(out), "tensors": len(tensors), "dtype": dtype + mixed}


def _source_dtypes(run: str | Path, hops: int = 8) -> tuple[str, dict] | None:
    """The dtypes recorded by ``convert --from mindspore`` for ``run`` (the
    main one, and the tensors saved otherwise), or for the base it was
    fine-tuned (``base.path``) or trained (``init_from``) from, followed back
    a few runs; None where the trail ends first."""
    from aisyn.train.run import RunDir

    for _ in range(hops):
        try:
            config = RunDir(run).read_config()
        except (OSError, ValueError):
            return None
        if not isinstance(config, dict):
            return None
        source = config.get("source")
        if isinstance(source, dict) and source.get("dtype") in DTYPES:
            others = source.get("dtypes", {})
            if not isinstance(others, dict) or not all(
                isinstance(k, str) and v in DTYPES for k, v in others.items()
            ):
                raise ValueError(f"{run}/config.json: source.dtypes is damaged")
            return source["dtype"], others
        base = config.get("base")
        run = base.get("path") if isinstance(base, dict) else config.get("init_from")
        if not isinstance(run, str) or not Path(run).is_dir():
            return None
    return None


def convert_to_hf(run: str | Path, out: str | Path) -> dict:
    """Write the latest weights of run folder ``run`` as a Hugging Face folder
    ``out``, built beside it and renamed into place."""
    from aisyn.model.families import build_model
    from aisyn.model.hf import HFConfig, write_hf_folder
    from aisyn.model.port import write_port_folder
    from aisyn.train import checkpoint as ckpt

    out = Path(out)
    cfg, state, weights = _run_weights(run, out)
    try:
        names = ckpt.check_weights(build_model(cfg, device="meta"), state, str(weights))
    except ckpt.CheckpointError as e:
        raise ckpt.CheckpointError(
            f"{e}; a split run holds one party's half: merge it first "
            "(aisyn split merge)"
        ) from None
    state = {k: state[k] for k in names}
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        if isinstance(cfg, HFConfig):
            write_hf_folder(cfg, state, tmp)
        else:
            write_port_folder(cfg, state, tmp)
        tokenizer = _export_tokenizer(Path(run), tmp)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "out": str(out),
        "tensors": len(state),
        "family": cfg.layout.family,
        "tokenizer": tokenizer,
    }


def _export_tokenizer(run: Path, out: Path) -> str | None:
    """Put the run's tokenizer into export folder ``out``, so the folder alone
    tokenises: a Hugging Face ``tokenizer.json`` with a
    ``tokenizer_config.json`` naming its end-of-text and pad tokens (what
    ``AutoTokenizer.from_pretrained`` reads), or PanGu's SentencePiece model
    as ``vocab.model`` (the port's name for it). Returns the file written,
    or None for a run folder without a tokenizer copy (said in the log)."""
    import json
    import logging

    from aisyn.data.tokenizer import HF_TOKENIZER_FILE, HFTokenizer, open_tokenizer
    from aisyn.train.run import TOKENIZER, RunDir

    src = run / TOKENIZER
    if not src.is_file():
        logging.getLogger("aisyn.convert").warning(
            "%s: no %s; the export has no tokenizer (copy the run's beside it)",
            run,
            TOKENIZER,
        )
        return None
    tok = open_tokenizer(src, RunDir(run).read_config().get("tokenizer"))
    if not isinstance(tok, HFTokenizer):
        shutil.copyfile(src, out / "vocab.model")
        return "vocab.model"
    shutil.copyfile(src, out / HF_TOKENIZER_FILE)
    settings = {
        # The fast tokenizer of any tokenizer.json, whatever the family's own
        # class would add (GPT-2's adds no BOS, Llama's would): encoding then
        # gives the ids the run was trained on.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": tok.tk.id_to_token(tok.eod_id),
        "pad_token": tok.tk.id_to_token(tok.pad_id),
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(settings, indent=2, ensure_ascii=False) + "\n"
    )
    return HF_TOKENIZER_FILE


def cmd_convert(args) -> None:
    """Convert PanGu-α weights: --from mindspore FILE.ckpt ... --out DIR writes a
    run folder usable as a base model (config read off the tensor shapes;
    a model-parallel run's rank files are merged, by --strategy FILE if given);
    --from pangu-port DIR --out DIR does the same for a folder of the public
    PyTorch port (config.json, weights, vocab.model), --from hf DIR --out DIR
    for a Hugging Face GPT-2/Llama/Qwen2 folder; --to mindspore --run RUN --out
    FILE.ckpt writes a run's latest weights as a MindSpore checkpoint (in the
    dtype of the run's MindSpore source, or --dtype), --to hf
    --run RUN --out DIR as a Hugging Face folder."""

    if args.source:
        if args.run or args.crc or args.dtype:
            raise ValueError("--run, --crc and --dtype go with --to, not --from")
        if args.strategy and args.source != "mindspore":
            raise ValueError("--strategy goes with --from mindspore")
        if args.source in ("pangu-port", "hf"):
            port = args.source == "pangu-port"
            if len(args.files) != 1 or not Path(args.files[0]).is_dir():
                what = "the port's model folder" if port else "the model's folder"
                raise ValueError(f"--from {args.source}: give {what}")
            if args.num_heads:
                raise ValueError(
                    f"--from {args.source} reads the heads from config.json"
                )
            convert = convert_from_port if port else convert_from_hf
            res = convert(args.files[0], args.out, tokenizer=args.tokenizer)
        else:
            if not args.files or not all(Path(f).is_file() for f in args.files):
                raise ValueError("--from mindspore: give one or more .ckpt files")
            res = convert_from_mindspore(
                args.files,
                args.out,
                tokenizer=args.tokenizer,
                num_heads=args.num_heads,
                strategy=args.strategy,
            )
            if res["skipped"]:
                print(f"skipped training state: {skipped_summary(res['skipped'])}")
        m = res["model"]
        print(
            f"wrote {res['out']}: {m.get('family', 'pangu')}, {m['num_layers']} "
            f"layers, hidden {m['hidden_size']}, "
            f"{m['num_heads']} heads, FFN {m['ffn_size']}, vocab {m['vocab_size']}, "
            f"{m['seq_len']} positions ({res['tensors']} tensors)"
        )
        return
    if args.files or args.tokenizer or args.num_heads or args.strategy:
        raise ValueError(
            f"--to {args.target} takes --run RUN and --out, no files, "
            "--tokenizer, --num-heads or --strategy"
        )
    if not args.run:
        raise ValueError(f"--to {args.target}: give --run RUN")
    if args.target == "hf":
        if args.crc or args.dtype:
            raise ValueError("--crc and --dtype go with --to mindspore")
        res = convert_to_hf(args.run, args.out)
    else:
        res = convert_to_mindspore(args.run, args.out, crc=args.crc, dtype=args.dtype)
    dtype = f", {res['dtype']}" if "dtype" in res else ""
    with_tok = f", tokenizer {res['tokenizer']}" if res.get("tokenizer") else ""
    print(f"wrote {res['out']}: {res['tensors']} tensors{dtype}{with_tok}")


def _existing(text: str) -> str:
    """An existing file or folder (checked while parsing, before anything is read)."""
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file or folder")
    return text


def register(sub) -> None:
    from aisyn.flagtable import REQUIRED, add_command, add_flags

    c = add_command(
        sub,
        "convert",
        cmd_convert,
        "model weights from/to MindSpore, the PanGu-α port or Hugging Face",
    )
    way = c.add_mutually_exclusive_group(required=True)
    way.add_argument(
        "--from", dest="source", choices=SOURCES, help="read SOURCE ... into --out"
    )
    way.add_argument(
        "--to", dest="target", choices=TARGETS, help="write --run's weights to --out"
    )
    c.add_argument(
        "files",
        nargs="*",
        type=_existing,
        metavar="SOURCE",
        help="with --from mindspore: the .ckpt, or its parts (embedding, backbone, "
        "head); with --from pangu-port or hf: the model folder",
    )
    add_flags(
        c,
        ("--out", None, REQUIRED, "--from: new run folder; --to: new .ckpt or folder"),
        ("--run", None, None, "--to: run folder whose latest weights to write"),
        (
            "--tokenizer",
            None,
            None,
            "--from: the model's tokenizer (PanGu's vocab.model; hf:DIR or a "
            "tokenizer.json for a Hugging Face one), copied in",
        ),
        (
            "--num-heads",
            positive_int,
            None,
            "--from: attention heads (default: the reference's for the hidden size)",
        ),
        ("--crc", "store_true", None, "--to: append MindSpore's CRC-32 trailer"),
        (
            "--strategy",
            _existing,
            None,
            "--from mindspore: the model-parallel run's strategy file "
            "(strategy_ckpt_save_file), to merge its rank files by (default: "
            "PanGu-α's layout)",
        ),
        (
            "--dtype",
            list(DTYPES),
            None,
            "--to mindspore: fp16, bf16 or fp32 (default: the dtype of the run's "
            "MindSpore source, else fp32)",
        ),
    )
