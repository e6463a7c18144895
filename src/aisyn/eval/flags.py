"""The evaluation flags of ``aisyn eval`` and ``aisyn split eval``, and the
arguments of ``evaluate_run`` / ``evaluate_split_run`` they make."""

from __future__ import annotations

import argparse

from aisyn import validate
from aisyn.flagtable import DEVICE, REQUIRED, add_flags


def add_eval_args(p: argparse.ArgumentParser) -> None:
    """What to evaluate on and how (``--run`` is each command's own)."""
    p.add_argument(
        "--data",
        default=None,
        help="prepared data folder: test-split loss, and cloze items "
        "built from its corpus's test documents",
    )
    p.add_argument("--cloze-file", default=None, help="score this .jsonl instead")
    p.add_argument(
        "--per-doc",
        type=validate.positive_int,
        default=3,
        help="cloze items per test document",
    )
    p.add_argument(
        "--max-items",
        type=validate.positive_int,
        default=None,
        help="score only the first N cloze items (default: all)",
    )
    p.add_argument(
        "--format",
        choices=["lm", "prompt"],
        default=None,
        help="scoring format (default: as the run was trained)",
    )
    add_flags(p, DEVICE)


def eval_options(args: argparse.Namespace) -> dict:
    """The keyword arguments of ``evaluate_run`` the flags ``add_eval_args``
    added say; ValueError if they leave nothing to evaluate."""
    if args.data is None and args.cloze_file is None:
        raise ValueError("give --data DIR (test loss + cloze) and/or --cloze-file F")
    return {
        "data_dir": args.data,
        "cloze_file": args.cloze_file,
        "per_document": args.per_doc,
        "max_items": args.max_items,
        "cloze_format": args.format,
        "device": args.device,
    }


# --- generation: `aisyn generate` and `aisyn split generate` --------------------


def add_generate_args(p: argparse.ArgumentParser) -> None:
    """The prompt, length and sampling flags (``--run`` is each command's own)."""
    add_flags(
        p,
        ("--prompt", None, REQUIRED, "text to continue"),
        ("--max-new-tokens", validate.positive_int, 50, "tokens to generate at most"),
        ("--temperature", validate.nonneg_float, 0.0, "0: greedy"),
        (
            "--top-k",
            validate.nonneg_int,
            0,
            "sample from the K likeliest tokens (0: all)",
        ),
        (
            "--top-p",
            validate.positive_probability,
            1.0,
            "sample from the smallest set of tokens holding this mass (1: all)",
        ),
        (
            "--seed",
            validate.seed,
            None,
            "sampling seed (default: random, printed)",
        ),
        DEVICE,
    )


def sampling_from_args(args: argparse.Namespace):
    """The ``Sampling`` of the flags, checked before any model loads; a sampled
    run without ``--seed`` gets a random one, printed on stderr so that it can
    be repeated."""
    import secrets
    import sys

    from aisyn.model.generate import Sampling

    seed = args.seed
    if seed is None and args.temperature > 0:
        seed = secrets.randbits(32)
        print(f"aisyn: sampling with --seed {seed}", file=sys.stderr)
    return Sampling(args.temperature, args.top_k, args.top_p, seed or 0)
