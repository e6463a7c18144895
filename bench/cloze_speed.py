"""Cloze scoring speed: the packed scorer against the per-candidate one.

Builds the items ``aisyn cloze build --corpus news --split test`` writes (one per
document), a seeded ``tiny`` model (random weights: the timing does not depend
on them), and times ``eval.cloze.score_per_candidate`` (what ``aisyn eval``
used to run, one sequence per candidate) and ``eval.cloze.score_packed`` (the
default now, one sequence per item) on the same items, threads and batch size
as ``aisyn eval`` (16). Each repeat shuffles the items afresh and alternates
which scorer goes first; the medians are reported.

    python bench/cloze_speed.py                      # both formats, 2 threads
    python bench/cloze_speed.py --formats lm --threads 1 --repeats 5

Prints, per format, items/s (wall clock) and CPU seconds of each scorer, the
speed-ups, the largest difference between the two scorers' scores and whether
they pick the same candidate for every item (hence the same accuracy). Wall
clock is taken on whatever else the machine is running; say so when quoting it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import numpy as np
import torch

from aisyn.data.cloze import build_items
from aisyn.data.corpora import load_corpus
from aisyn.data.tokenizer import PanguTokenizer
from aisyn.eval.cloze import (
    FORMATS,
    encode_items,
    score_packed,
    score_per_candidate,
)
from aisyn.model.families import build_model

SCORERS = {"per-candidate": score_per_candidate, "packed": score_packed}


def timed(scorer, model, encoded, batch_size: int, pad_id: int):
    wall, cpu = time.perf_counter(), time.process_time()
    scores = scorer(model, encoded, batch_size=batch_size, pad_id=pad_id)
    return scores, time.perf_counter() - wall, time.process_time() - cpu


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    ap.add_argument("--model", default="tiny", help="preset (random weights)")
    ap.add_argument("--items", type=int, default=None, help="first N items only")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    items = build_items(load_corpus("news"), "test", per_document=1)[: args.items]
    tok = PanguTokenizer.load()
    model = build_model(args.model, seed=args.seed).eval()
    print(
        f"# cloze scoring: {len(items)} news test items, {args.model} model "
        f"({model.num_parameters() / 1e6:.2f}M parameters, seed {args.seed}), "
        f"{args.threads} threads, batch {args.batch_size}, median of "
        f"{args.repeats}, torch {torch.__version__}"
    )
    print(
        "| format | per-candidate items/s | packed items/s | speed-up (wall) "
        "| per-candidate CPU s | packed CPU s | speed-up (CPU) | max score diff "
        "| same choices |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for fmt in args.formats:
        encoded = encode_items(items, tok, model.config.seq_len, fmt)
        for scorer in SCORERS.values():  # warm-up: allocator, thread pool, kernels
            timed(scorer, model, encoded[:8], args.batch_size, tok.pad_id)
        wall: dict[str, list[float]] = {name: [] for name in SCORERS}
        cpu: dict[str, list[float]] = {name: [] for name in SCORERS}
        diff, same_choices = 0.0, True
        for r in range(args.repeats):
            order = list(range(len(encoded)))
            random.Random(args.seed + r).shuffle(order)
            shuffled = [encoded[i] for i in order]
            names = list(SCORERS) if r % 2 == 0 else list(SCORERS)[::-1]
            scores = {}
            for name in names:
                scores[name], w, c = timed(
                    SCORERS[name], model, shuffled, args.batch_size, tok.pad_id
                )
                wall[name].append(w)
                cpu[name].append(c)
            a, b = scores["per-candidate"], scores["packed"]
            for x, y in zip(a, b, strict=True):
                diff = max(diff, float(np.abs(x - y).max()))
                same_choices &= int(np.argmax(x)) == int(np.argmax(y))
        w = {name: statistics.median(v) for name, v in wall.items()}
        c = {name: statistics.median(v) for name, v in cpu.items()}
        slow, fast = "per-candidate", "packed"
        print(
            f"| {fmt} | {len(items) / w[slow]:.1f} | {len(items) / w[fast]:.1f} "
            f"| {w[slow] / w[fast]:.1f}x | {c[slow]:.1f} | {c[fast]:.1f} "
            f"| {c[slow] / c[fast]:.1f}x | {diff:.1e} | {same_choices} |"
        )
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
