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

``--split`` adds split generation (``aisyn split generate``'s decoder, cut
u:1,1, the same weights) against a compute party spawned on this machine
(``aisyn split serve``, its own process, gRPC loopback, plaintext), each party
with its own KV cache; its tokens must equal the unsplit ones.

    python bench/generate_speed.py --models tiny --split
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from aisyn.model.families import build_model
from aisyn.model.generate import Sampling, decode, generate


def timed(model, prompt: list[int], new: int, use_cache: bool):
    start = time.perf_counter()
    out = generate(model, prompt, new, use_cache=use_cache)
    return out, time.perf_counter() - start


@contextlib.contextmanager
def split_session(name: str, seed: int, threads: int):
    """A data party's ``DataSession`` (cut u:1,1, the weights of
    ``build_model(name, seed=seed)``) in a generate session with a compute
    party spawned on loopback, which holds the same weights' middle blocks."""
    from aisyn.model.segments import COMPUTE_PARTY, DATA_PARTY, parse_partition
    from aisyn.split import protocol as proto
    from aisyn.split.client.data_party import DataSession
    from aisyn.split.party import PartyState
    from aisyn.split.session import open_grpc, spawn_compute_party
    from aisyn.train import checkpoint as ckpt
    from aisyn.train.config import TrainConfig
    from aisyn.train.run import RunDir

    cfg = build_model(name, device="meta").config
    cut = parse_partition("u:1,1", cfg)
    train = TrainConfig(steps=1, seed=seed, device="cpu")
    cpu = torch.device("cpu")
    run_id = "bench-generate"
    with tempfile.TemporaryDirectory() as tmp:
        # B serves a checkpoint of its half; a generate session loads it (step
        # 1: a session at step 0 starts from init, not from a checkpoint)
        b = PartyState(cfg, cut, COMPUTE_PARTY, train, cpu)
        state = {"party": COMPUTE_PARTY, "run_id": run_id}
        ckpt.save(RunDir(Path(tmp) / "b" / run_id).checkpoints, 1, b.tensors(), state)
        server = spawn_compute_party(
            Path(tmp) / "spawned",
            cfg,
            cut,
            Path(tmp) / "b",
            insecure=True,
            env={"OMP_NUM_THREADS": str(threads)},
        )
        try:
            a = PartyState(cfg, cut, DATA_PARTY, train, cpu)
            a.train(False)
            hello = proto.hello(
                purpose="generate",
                run_id=run_id,
                model=cfg.to_dict(),
                partition=cut.to_dict(),
                train=train,
                eval_step=1,
            )
            with open_grpc(server.settings, hello, codec="none") as opened:
                yield DataSession(a, opened.link, eod_id=None)
        finally:
            server.stop()


def timed_split(session, prompt: list[int], new: int):
    start = time.perf_counter()
    decoder = session.decoder(len(prompt) + new)
    with torch.inference_mode():
        out = decode(decoder, prompt, new, Sampling())
    decoder.close()
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
    ap.add_argument(
        "--split",
        action="store_true",
        help="also split generation against a compute party on gRPC loopback",
    )
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    print(
        f"# greedy generation on CPU: random-weight presets (seed {args.seed}), "
        f"prompt {args.prompt_len} tokens, new tokens up to seq_len, "
        f"{args.threads} threads, median of {args.repeats}, torch {torch.__version__}"
    )
    split_head = " tokens/s split (gRPC loopback) | split same tokens |"
    print(
        "| preset | params (M) | new tokens | tokens/s cached | tokens/s uncached "
        "| speed-up | same tokens |" + (split_head if args.split else "")
    )
    print("|---|---|---|---|---|---|---|" + ("---|---|" if args.split else ""))
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
        split_cells = ""
        if args.split:
            with split_session(name, args.seed, args.threads) as session:
                timed_split(session, prompt, 4)  # warm-up, both processes
                runs = [timed_split(session, prompt, new) for _ in range(args.repeats)]
            split_wall = statistics.median(w for _, w in runs)
            same = all(out == outs[True] for out, _ in runs)
            split_cells = f" {new / split_wall:.1f} | {same} |"
        print(
            f"| {name} | {model.num_parameters() / 1e6:.2f} | {new} "
            f"| {new / cached:.1f} | {new / full:.1f} | {full / cached:.1f}x "
            f"| {outs[True] == outs[False]} |" + split_cells
        )
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
