"""Generation speed: greedy decoding with the KV cache against recomputing the
whole sequence for every new token.

Builds each preset with random weights (the timing does not depend on them;
the vocabulary is the presets' 8 000), feeds a random prompt and times
``aisyn.model.generate.generate`` with ``use_cache=True`` and ``False``, new
tokens filling the model's ``seq_len``. Each repeat alternates which goes first;
medians are reported, and both must produce the same tokens.

    python bench/generate_speed.py                         # tiny and small
    python bench/generate_speed.py --models small --threads 2 --repeats 5

Prints, per preset, new tokens/s (wall clock) with and without the cache and
the speed-up. Wall clock is taken on whatever else the machine is running; say
so when quoting it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from aisyn.model.generate import generate
from aisyn.model.pangu import build_model


def timed(model, prompt: list[int], new: int, use_cache: bool):
    start = time.perf_counter()
    out = generate(model, prompt, new, use_cache=use_cache)
    return out, time.perf_counter() - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "small"])
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    # One thread by default: a decoding step of these models is too small to
    # split across threads, and with two on a busy 2-core box the threads wait
    # on each other (measured 8x slower while other jobs ran).
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    print(
        f"# greedy generation on CPU: random-weight presets (seed {args.seed}), "
        f"prompt {args.prompt_len} tokens, new tokens up to seq_len, "
        f"{args.threads} threads, median of {args.repeats}, torch {torch.__version__}"
    )
    print(
        "| preset | params (M) | new tokens | tokens/s cached | tokens/s uncached "
        "| speed-up | same tokens |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        model = build_model(name, seed=args.seed).eval()
        cfg = model.config
        g = torch.Generator().manual_seed(args.seed)
        prompt = torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=g)
        prompt = prompt.tolist()
        new = cfg.seq_len - args.prompt_len
        for use_cache in (True, False):  # warm-up: allocator, thread pool, kernels
            timed(model, prompt, 4, use_cache)
        wall: dict[bool, list[float]] = {True: [], False: []}
        outs: dict[bool, list[int]] = {}
        for r in range(args.repeats):
            for use_cache in (True, False) if r % 2 == 0 else (False, True):
                outs[use_cache], w = timed(model, prompt, new, use_cache)
                wall[use_cache].append(w)
        cached, full = (statistics.median(wall[c]) for c in (True, False))
        print(
            f"| {name} | {model.num_parameters() / 1e6:.2f} | {new} "
            f"| {new / cached:.1f} | {new / full:.1f} | {full / cached:.1f}x "
            f"| {outs[True] == outs[False]} |"
        )
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
