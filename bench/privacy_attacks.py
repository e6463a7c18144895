"""What each trained attack of the privacy audit recovers at one cut, as the
size of B's inverter and its public text grow (issue 38, item 5).

On the comparison's cached base and shards (``--preset``: news is A's text,
reviews the public text, as ``aisyn privacy audit --preset`` uses them), the
base sends rows at ``--cut``; for each forward noise multiplier of
``--noise`` (0: undefended; else ``split.defence.cut_dp``'s Gaussian mechanism on
the activations, its bound calibrated on the public rows) B fits, on public
rows sent through the same mechanism:

* the linear decoder (``attacks.LearnedDecoder``) on ``--decoder-rows`` rows,
* the sequence inverter (``inverters.SequenceInverter``) on ``--public-rows``,
* its known-plaintext bound, fine-tuned on ``--known-pairs`` rows of A's
  train split (never the rows attacked),
* similarity inference on the activations (inputs) and on the gradients
  (labels), on ``--public-rows``,

and reports each one's recovery on ``--samples`` rows of A's test split,
beside the frequent-token rate, with the seconds each fit took.

    python bench/privacy_attacks.py                      # ci base, ~5 min on 2 cores
    python bench/privacy_attacks.py --preset full --cut u:1,1 --public-rows 3500 \\
        --steps 1000

``--threads`` (default 1): torch's CPU threads. On a box whose cores other
jobs share, one thread is many times faster than two for these small
tensors (spinning threads wait on busy cores).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from aisyn.data.shards import TokenShards
from aisyn.data.tokenizer import PanguTokenizer
from aisyn.model.segments import parse_partition
from aisyn.privacy.attacks import LearnedDecoder, frequent_token_rate, recovery
from aisyn.privacy.audit import public_crossing
from aisyn.privacy.frontier import protected
from aisyn.privacy.inverters import (
    SequenceInverter,
    SimilarityInference,
    known_plaintext,
)
from aisyn.split.defence import cut_dp as dp
from aisyn.split.defence.calibration import calibrate
from aisyn.testbed.inputs import cached_base, cached_shards
from aisyn.testbed.presets import get_preset
from aisyn.train.models import load_run_model
from aisyn.validate import nonneg_float, positive_int


def _rows(shards: TokenShards, n: int, g: torch.Generator) -> torch.Tensor:
    return shards.batch(torch.randperm(len(shards), generator=g)[:n])


def measure(args) -> list[dict]:
    experiments = get_preset(args.preset)
    tok = PanguTokenizer.load()
    news = cached_shards("news", tok, experiments)
    reviews = cached_shards("reviews", tok, experiments)
    base = cached_base(experiments, [news, reviews], tok, "cpu")
    model, _ = load_run_model(base)
    model.eval().requires_grad_(False)
    vocab = model.config.vocab_size
    cut = parse_partition(args.cut, model.config)
    g = torch.Generator().manual_seed(args.seed)
    sha = tok.sha256
    attacked = _rows(
        TokenShards.open(news, "test", tokenizer_sha256=sha), args.samples, g
    )
    public = _rows(
        TokenShards.open(reviews, "train", tokenizer_sha256=sha), args.public_rows, g
    )
    own = _rows(
        TokenShards.open(news, "train", tokenizer_sha256=sha), args.known_pairs, g
    )
    step = len(attacked)  # the gradient's scale: rows sent per step, as attacked
    sent = {
        name: public_crossing(model, rows, cut, step)
        for name, rows in (("attacked", attacked), ("public", public), ("own", own))
    }
    clip = calibrate(model, public[:256], args.cut, step).forward
    return [measure_point(args, vocab, sent, clip, sigma) for sigma in args.noise]


def measure_point(args, vocab: int, sent: dict, clip: float, sigma: float) -> dict:
    """Every attack on what ``sent`` becomes under forward noise ``sigma``."""
    defence = (
        dp.CutDefence(forward=dp.Gaussian(clip, sigma)) if sigma else dp.CutDefence()
    )
    seen, pub, mine = (
        protected(sent[k], defence) for k in ("attacked", "public", "own")
    )
    row = {
        "cut": args.cut,
        "forward_noise": sigma,
        "clip": clip,
        "frequent_token_inputs": frequent_token_rate(seen.inputs),
        "frequent_token_labels": frequent_token_rate(seen.labels),
    }

    def timed(name, fit, predict, truth):
        t0 = time.perf_counter()
        attacker = fit()
        row[name] = recovery(predict(attacker), truth)
        row[f"{name}_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps({k: row[k] for k in ("forward_noise", name, f"{name}_s")}))
        return attacker

    d = args.decoder_rows
    timed(
        "linear",
        lambda: LearnedDecoder(pub.acts.shape[-1], vocab).fit(
            pub.acts[:d], pub.inputs[:d]
        ),
        lambda a: a.predict(seen.acts),
        seen.inputs,
    )
    inverter = timed(
        "sequence_inverter",
        lambda: SequenceInverter(
            pub.acts.shape[-1],
            vocab,
            pub.acts.shape[1],
            width=args.width,
            layers=args.layers,
            heads=args.heads,
            seed=args.seed,
        ).fit(
            pub.acts,
            pub.inputs,
            steps=args.steps,
            lr=args.lr,
            batch=args.batch,
            seed=args.seed,
        ),
        lambda a: a.predict(seen.acts),
        seen.inputs,
    )
    timed(
        "known_plaintext",
        lambda: known_plaintext(
            inverter,
            mine.acts,
            mine.inputs,
            steps=args.known_steps,
            lr=args.lr,
            batch=args.batch,
            seed=args.seed,
        ),
        lambda a: a.predict(seen.acts),
        seen.inputs,
    )
    timed(
        "similarity_inputs",
        lambda: SimilarityInference(vocab).fit(pub.acts, pub.inputs),
        lambda a: a.predict(seen.acts),
        seen.inputs,
    )
    timed(
        "similarity_labels",
        lambda: SimilarityInference(vocab, normalise=True).fit(pub.grad, pub.labels),
        lambda a: a.predict(seen.grad),
        seen.labels,
    )
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=["ci", "full"], default="ci")
    p.add_argument("--cut", default="u:1,0")
    p.add_argument("--samples", type=positive_int, default=16, help="rows attacked")
    p.add_argument("--public-rows", type=positive_int, default=1000)
    p.add_argument("--decoder-rows", type=positive_int, default=256)
    p.add_argument("--known-pairs", type=positive_int, default=256)
    p.add_argument("--width", type=positive_int, default=128)
    p.add_argument("--layers", type=positive_int, default=2)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--steps", type=positive_int, default=300)
    p.add_argument("--known-steps", type=positive_int, default=100)
    p.add_argument("--batch", type=positive_int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--noise",
        type=nonneg_float,
        nargs="+",
        default=[0.0, 0.003, 0.1],
        help="forward noise multipliers (0: undefended)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    rows = measure(args)
    cols = [
        "forward_noise",
        "linear",
        "sequence_inverter",
        "known_plaintext",
        "similarity_inputs",
        "frequent_token_inputs",
        "similarity_labels",
        "frequent_token_labels",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        cells = [
            f"{r[c]:g}" if c == "forward_noise" else f"{100 * r[c]:.1f} %" for c in cols
        ]
        print("| " + " | ".join(cells) + " |")
    print(f"done in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
