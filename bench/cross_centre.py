"""Training across centres on a wide-area link (issue 22): DiLoCo against DDP.

Every run is ``aisyn train`` under torchrun on this box (gloo), the same model,
seed and token budget: DDP (``--sync ddp``) all-reduces each step's gradients;
DiLoCo (``--sync diloco``) lets each centre take H steps alone, then averages
the centres' deltas. Reported per run:

* the final validation loss (the mean over the domains' valid splits) and
  how far above DDP's it is;
* the bytes each centre sent: DiLoCo's as its run counted them, DDP's those
  of a ring all-reduce of the fp32 gradients every step (2 (N-1)/N of them);
* compute: one centre's step time on its own share of the batch, measured
  alone on this box (the centres share two cores here, so the runs' own
  clocks would say nothing about a centre on its own hardware);
* the wall time on a wide-area link, *computed* from those bytes and that
  compute (not shaped): a ring collective of N centres takes its bytes over
  the bandwidth plus one latency per hop (2 (N-1) hops of RTT/2 for an
  all-reduce, N-1 for an all-gather); DDP is given full overlap of its
  all-reduce with the backward pass (2/3 of a step), DiLoCo none (it
  blocks at each outer step), Streaming DiLoCo (``--fragments F
  --overlap-steps T``) T steps of compute for each fragment's exchange,
  except the run's last one, which flushes the other fragments blocking.
  Utilisation = compute / wall.

    python bench/cross_centre.py --quick

prints, among others, ``diloco H=100: N centres, shared data: loss N.N %
above DDP, N x fewer bytes, utilisation N % at 100 Mbit/s (DDP N %)``, and
writes the loss against
tokens and against modelled wall time to ``--plot`` (default
cross_centre.png). ``--steps``, ``--batch`` (global, all centres together)
and ``--lr`` (the AdamW peak lr of DDP and of DiLoCo's inner steps) change the
budget the runs share; the defaults are 300 / 1 500 steps, 16 and 3e-3.

    nice -n 10 python bench/cross_centre.py --long --batch 8 --json long.json

runs DiLoCo at H = 100 for 3 000 steps (30 outer steps; OpenDiLoCo's outer
lr 0.7 and momentum 0.9, fp32 deltas) against DDP at ``tiny``, on 2 and 4
centres, shared and non-IID data (2 centres: news | reviews; 4: two halves
of each, alternating), over ``--seeds`` (1 2), ``--lanes`` runs at a time.
DDP is one process on the global batch: what DDP's ranks compute together
(the project's DDP matches it to 1e-5), its bytes those of the ring
all-reduce at that many centres. It prints per centre count and data
``diloco H=100: N centres, shared data: loss +N.NN % against DDP (seed 1
..., seed 2 ...; spread N.NN points), N x fewer bytes, utilisation N.N % at
100 Mbit/s (...)`` and the compute per step that 90 % needs, and the honest
runs' largest delta norm ratio and smallest cosine (the delta guard's
margins). ``--summarise long.json`` prints the table again from the runs
the file holds (a run cut short keeps those that ended).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from aisyn.data.corpora import load_corpus  # noqa: E402
from aisyn.data.shards import open_many, prepare  # noqa: E402
from aisyn.data.tokenizer import PanguTokenizer  # noqa: E402
from aisyn.model.families import ModelConfig, build_model, load_config  # noqa: E402
from aisyn.train.config import TrainConfig  # noqa: E402
from aisyn.train.diloco import encoded_bytes, ring_bytes_sent  # noqa: E402
from aisyn.train.models import load_run_model  # noqa: E402
from aisyn.train.objective import evaluate_loss  # noqa: E402
from aisyn.train.pretrain import train  # noqa: E402
from aisyn.train.run import read_metrics  # noqa: E402

LINKS = {"1 Gbit/s": 1e9 / 8, "100 Mbit/s": 100e6 / 8}  # bytes per second
RTT_S = 0.050


def shards(name: str, seq_len: int, docs: int) -> Path:
    root = Path(os.environ.get("AISYN_CACHE", Path.home() / ".cache" / "aisyn"))
    out = root / "bench" / f"{name}-{seq_len}-{docs}"
    if not (out / "manifest.json").is_file():
        prepare(load_corpus(name), PanguTokenizer.load(), seq_len, out,
                max_documents=docs, corpus_specs=[name])  # fmt: skip
    return out


def torchrun(
    n: int, out: Path, model: Path, data: list[Path], args: list[str]
) -> float:
    """``aisyn train`` on ``n`` ranks (one process, without torchrun, for
    n = 1); returns its wall seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
              str(n)] if n > 1 else []  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable, *launch, "-m", "aisyn.cli", "train", "--quiet",
            "--model", str(model), "--out", str(out),
            *[a for d in data for a in ("--data", str(d))], *args,
        ],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"{out}: {proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def valid_loss(run: Path, data: list[Path]) -> float:
    model, _ = load_run_model(run)
    return sum(
        evaluate_loss(model, open_many([d], "valid")[0], batch_size=32, max_batches=8)
        for d in data
    ) / len(data)


def step_compute_s(cfg: ModelConfig, data: Path, batch: int, steps: int) -> float:
    """One centre's seconds per step on ``batch`` rows, alone on this box."""
    with tempfile.TemporaryDirectory() as tmp:
        torch.set_num_threads(1)  # as each torchrun rank has
        tc = TrainConfig(steps=steps, batch_size=batch, log_every=1, seed=1)
        train(cfg, [data], Path(tmp) / "r", tc, progress=False)
        recs = [r for r in read_metrics(Path(tmp) / "r" / "metrics.jsonl")]
        times = [r["elapsed_s"] for r in recs if "elapsed_s" in r]
        return (times[-1] - times[1]) / (len(times) - 2)


def ring_latency(n: int, op: str) -> float:
    hops = 2 * (n - 1) if op == "all_reduce" else n - 1
    return hops * RTT_S / 2


def modelled(run: dict, compute_s: float, steps: int, n: int, bw: float) -> float:
    """Wall seconds of ``run`` on a link of ``bw`` bytes/s (see the header)."""
    if run["sync"] == "ddp":
        comm = ring_latency(n, "all_reduce") + run["bytes_per_step"] / bw
        per_step = compute_s / 3 + max(2 * compute_s / 3, comm)
        return steps * per_step
    op = "all_reduce" if run["precision"] == "fp32" else "all_gather"
    fragments, overlap = run.get("fragments", 1), run.get("overlap", 0)
    exchanges = steps // run["h"] * fragments
    flush = fragments - 1  # the last step's, of the fragments synced earlier
    # + the delta screening's all-gather of 24 bytes a centre first
    each = (
        ring_latency(n, "all_gather")
        + ring_latency(n, op)
        + run["bytes"] / (exchanges + flush) / bw
    )
    hidden = overlap * compute_s
    return steps * compute_s + exchanges * max(0.0, each - hidden) + flush * each


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=16, help="global batch, all centres")
    ap.add_argument("--lr", type=float, default=3e-3, help="(inner) AdamW peak lr")
    ap.add_argument("--plot", default="cross_centre.png")
    ap.add_argument("--json", default=None)
    ap.add_argument("--long", action="store_true",
                    help="H = 100 over 30 outer steps, 2 and 4 centres, shared "
                    "and non-IID, against DDP, over --seeds (issue 37)")  # fmt: skip
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--seq", type=int, default=32, help="--long: sequence length")
    ap.add_argument("--inner-steps", type=int, default=100, help="--long: H")
    ap.add_argument("--lanes", type=int, default=3, help="--long: runs at once")
    ap.add_argument(
        "--summarise",
        default=None,
        metavar="JSON",
        help="print --long's table from the runs a --json holds",
    )
    args = ap.parse_args(argv)
    if args.long or args.summarise:
        args.steps = args.steps or 3000
        if args.batch % 4:
            raise SystemExit(f"--batch {args.batch}: must split over 4 centres")
        if args.summarise:
            saved = json.loads(Path(args.summarise).read_text())
            compute = {int(k): v for k, v in saved["compute"].items()}
            long_summary(saved["results"], args, saved["params"], compute)
            return 0
        return long_main(args)
    steps = args.steps or (300 if args.quick else 1500)
    seq = 64
    cfg = load_config("tiny" if args.quick else "small", seq_len=seq)
    batch = args.batch
    if batch < 4 or batch % 4:
        raise SystemExit(f"--batch {batch}: must split over 2 and 4 centres")
    docs = 3000 if args.quick else 20000
    news, reviews = shards("news", seq, docs), shards("reviews", seq, docs)
    params = sum(p.numel() for p in build_model(cfg, device="meta").parameters())
    print(
        f"# cross-centre: PanGu-a hidden {cfg.hidden_size}, {cfg.num_layers} layers "
        f"({params / 1e6:.1f} M params, {4 * params / 1e6:.1f} MB fp32), seq {seq}, "
        f"global batch {batch}, lr {args.lr:g}, {steps} steps (same tokens in "
        f"every run); "
        f"links {', '.join(LINKS)} at {RTT_S * 1e3:.0f} ms RTT, modelled; "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs",
        flush=True,
    )
    plans = [
        # (centres, data, label, runs: (sync, H, precision, fragments,
        # overlap, outer lr and momentum: None for the defaults, 0.7 / 0.9))
        (2, "shared", [news], [("ddp", None, None, 1, 0, None)] + [
            ("diloco", h, "fp32", 1, 0, None) for h in (10, 50, 100)
        ] + [("diloco", 100, "int8", 1, 0, None),
             ("diloco", 100, "fp32", 4, 5, None),
             ("diloco", 100, "fp32", 1, 0, (1.0, 0.0))]),
        (2, "non-IID", [news, reviews],
         [("ddp", None, None, 1, 0, None), ("diloco", 100, "fp32", 1, 0, None),
          ("diloco", 100, "fp32", 1, 0, (1.0, 0.0))]),
        (4, "shared", [news],
         [("ddp", None, None, 1, 0, None), ("diloco", 100, "fp32", 1, 0, None),
          ("diloco", 100, "fp32", 1, 0, (1.0, 0.0)),
          ("diloco", 100, "int8", 1, 0, (1.0, 0.0))]),
    ]  # fmt: skip
    results = []
    curves = {}
    with tempfile.TemporaryDirectory(prefix="aisyn-xc-") as tmp:
        model = Path(tmp) / "model.json"
        model.write_text(json.dumps(cfg.to_dict()))
        compute = {
            n: step_compute_s(cfg, news, batch // n, min(steps, 40)) for n in (2, 4)
        }
        for n, label, data, runs in plans:
            ddp_loss = None
            for sync, h, precision, fragments, overlap, outer in runs:
                name = f"{n}c-{label}-{sync}" + (f"-h{h}-{precision}" if h else "")
                if fragments > 1:
                    name += f"-f{fragments}-o{overlap}"
                if outer:
                    name += f"-lr{outer[0]:g}-m{outer[1]:g}"
                out = Path(tmp) / name
                common = ["--steps", str(steps), "--batch-size", str(batch),
                          "--lr", str(args.lr), "--warmup", "20", "--log-every", "10",
                          "--seed", "1"]  # fmt: skip
                if sync == "diloco":
                    common += ["--sync", "diloco", "--inner-steps", str(h),
                               "--delta-precision", precision, "--centre-data",
                               "own" if label == "non-IID" else "split",
                               "--fragments", str(fragments),
                               "--overlap-steps", str(overlap)]  # fmt: skip
                    if outer:
                        common += ["--outer-lr", str(outer[0]),
                                   "--outer-momentum", str(outer[1])]  # fmt: skip
                wall = torchrun(n, out, model, data, common)
                loss = valid_loss(out, data)
                recs = read_metrics(out / "metrics.jsonl")
                r = {"centres": n, "data": label, "sync": sync, "h": h,
                     "precision": precision, "fragments": fragments,
                     "overlap": overlap, "outer": outer, "valid_loss": loss,
                     "box_wall_s": wall}  # fmt: skip
                if sync == "ddp":
                    r["bytes_per_step"] = ring_bytes_sent(4 * params, n, "all_reduce")
                    r["bytes"] = r["bytes_per_step"] * steps
                    ddp_loss = loss
                else:
                    r["bytes"] = max(x.get("outer_bytes_sent", 0) for x in recs)
                for link, bw in LINKS.items():
                    t = modelled(r, compute[n], steps, n, bw)
                    r[f"wall_s {link}"] = t
                    r[f"utilisation {link}"] = steps * compute[n] / t
                results.append(r)
                curves[name] = (
                    # every centre together: the same in every run
                    [(x["step"] * batch * seq, x["loss"]) for x in recs if "loss" in x],
                    r[f"wall_s {'100 Mbit/s'}"] / steps,
                    n,
                )
                tag = "DDP" if sync == "ddp" else f"diloco H={h} {precision}"
                if fragments > 1:
                    tag += f" streaming {fragments} fragments, {overlap} overlapped"
                if outer:
                    tag += f" outer lr {outer[0]:g} momentum {outer[1]:g}"
                print(
                    f"{n} centres, {label} data, {tag}: valid loss {loss:.4f}, "
                    f"{r['bytes'] / 1e6:.1f} MB sent per centre, utilisation "
                    f"{100 * r['utilisation 1 Gbit/s']:.0f} % at 1 Gbit/s, "
                    f"{100 * r['utilisation 100 Mbit/s']:.0f} % at 100 Mbit/s",
                    flush=True,
                )
            ddp = next(
                x for x in results
                if (x["centres"], x["data"], x["sync"]) == (n, label, "ddp")
            )  # fmt: skip
            for x in results:
                if (x["centres"], x["data"]) != (n, label) or x["sync"] == "ddp":
                    continue
                extra = "" if x["precision"] == "fp32" else f" {x['precision']}"
                if x["fragments"] > 1:
                    extra += (
                        f" streaming {x['fragments']} fragments, "
                        f"{x['overlap']} steps overlapped"
                    )
                if x["outer"]:
                    extra += f" outer lr {x['outer'][0]:g} momentum {x['outer'][1]:g}"
                print(
                    f"diloco H={x['h']}{extra}: {n} centres, {label} data: loss "
                    f"{100 * (x['valid_loss'] / ddp_loss - 1):.1f} % above DDP, "
                    f"{ddp['bytes'] / x['bytes']:.0f} x fewer bytes, utilisation "
                    f"{100 * x['utilisation 100 Mbit/s']:.0f} % at 100 Mbit/s "
                    f"(DDP {100 * ddp['utilisation 100 Mbit/s']:.0f} %)",
                    flush=True,
                )
    plot(curves, Path(args.plot), steps)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


# --- the long comparison (issue 37, item 17) -------------------------------------

#: the long mode's runs: (centres, data label); the data folders by label
LONG_CONFIGS = [(2, "shared"), (4, "shared"), (2, "non-IID"), (4, "non-IID")]


def halves(name: str, seq_len: int, docs: int) -> list[Path]:
    """A corpus's first ``docs`` documents as two folders of alternate
    documents: two centres of one domain that do not read the same rows."""
    from aisyn.data.corpora import Corpus

    root = Path(os.environ.get("AISYN_CACHE", Path.home() / ".cache" / "aisyn"))
    corpus = load_corpus(name)
    out = []
    for i in range(2):
        folder = root / "bench" / f"{name}-{seq_len}-{docs}-half{i}"
        if not (folder / "manifest.json").is_file():
            half = Corpus(f"{name}-half{i}", corpus.documents[:docs][i::2],
                          corpus.sources)  # fmt: skip
            prepare(half, PanguTokenizer.load(), seq_len, folder,
                    corpus_specs=[name])  # fmt: skip
        out.append(folder)
    return out


def delta_stats(recs: list[dict]) -> dict:
    """Over an honest run's outer steps: the largest ratio of a centre's
    delta norm to the other centres' median, the smallest cosine to the
    run's direction, and how many deltas were left out."""
    import statistics

    ratio, cosine, refused = 0.0, 1.0, 0
    for r in recs:
        norms = r.get("outer_delta_norms")
        if not norms:
            continue
        for i, x in enumerate(norms):
            others = [y for j, y in enumerate(norms) if j != i and y]
            if x and others:
                ratio = max(ratio, x / statistics.median(others))
        cosine = min([cosine, *[c for c in r["outer_delta_cosines"] if c is not None]])
        refused += len(r.get("outer_refused", []))
    return {"max_norm_ratio": ratio, "min_cosine": cosine, "refused": refused}


def long_jobs(seeds: list[int], data: dict) -> list[tuple]:
    """Every run of the long mode, seed by seed (the first seed's whole
    table first): DDP once per data set (a single process on the global
    batch: what DDP's ranks compute together), DiLoCo per centre count."""
    jobs = []
    for seed in seeds:
        seen = set()
        for n, label in LONG_CONFIGS:
            folders = data[(n, label)]
            if tuple(folders) not in seen:  # shared data: one DDP for 2 and 4
                seen.add(tuple(folders))
                jobs.append(("ddp", n, label, seed))
            jobs.append(("diloco", n, label, seed))
    return jobs


def run_long_job(job, args, tmp: Path, model: Path, data: dict) -> dict:
    sync, n, label, seed = job
    folders = data[(n, label)]
    name = f"{sync}-{n}c-{label}-s{seed}"
    out = tmp / name
    common = ["--steps", str(args.steps), "--batch-size", str(args.batch),
              "--lr", str(args.lr), "--warmup", "100", "--log-every", "10",
              "--seed", str(seed)]  # fmt: skip
    if sync == "diloco":
        own = "own" if label == "non-IID" else "split"
        common += ["--sync", "diloco", "--inner-steps", str(args.inner_steps),
                   "--centre-data", own]  # fmt: skip
    wall = torchrun(n if sync == "diloco" else 1, out, model, folders, common)
    recs = read_metrics(out / "metrics.jsonl")
    r = {"sync": sync, "centres": n, "data": label, "seed": seed,
         "valid_loss": valid_loss(out, folders), "box_wall_s": wall,
         "curve": [(x["step"], x["loss"]) for x in recs if "loss" in x]}  # fmt: skip
    if sync == "diloco":
        r["bytes"] = max(x.get("outer_bytes_sent", 0) for x in recs)
        r.update(delta_stats(recs))
    return r


def compute_for(run: dict, share: float, steps: int, n: int, bw: float) -> float:
    """The least compute per step at which ``run`` keeps ``share`` of the
    wall time computing on a link of ``bw`` (bisection: utilisation rises
    with compute)."""
    low, high = 0.0, 100.0
    for _ in range(60):
        mid = (low + high) / 2
        if steps * mid / modelled(run, mid, steps, n, bw) >= share:
            high = mid
        else:
            low = mid
    return high


def long_summary(results: list[dict], args, params: int, compute: dict) -> None:
    """The table of the long mode from whatever runs have ended."""
    import statistics

    steps, h = args.steps, args.inner_steps
    ddp = {(r["data"], r["centres"] if r["data"] == "non-IID" else 0, r["seed"]): r
           for r in results if r["sync"] == "ddp"}  # fmt: skip
    for n, label in LONG_CONFIGS:
        runs = sorted((r for r in results if r["sync"] == "diloco"
                       and (r["centres"], r["data"]) == (n, label)),
                      key=lambda r: r["seed"])  # fmt: skip
        pairs = []
        for r in runs:
            base = ddp.get((label, n if label == "non-IID" else 0, r["seed"]))
            if base is not None:
                pairs.append((r, base))
        if not pairs:
            print(f"diloco H={h}: {n} centres, {label} data: not run", flush=True)
            continue
        gaps = [100 * (r["valid_loss"] / b["valid_loss"] - 1) for r, b in pairs]
        seeds = ", ".join(f"seed {r['seed']} {g:+.2f} %" for (r, _), g in
                          zip(pairs, gaps, strict=True))  # fmt: skip
        ddp_bytes = ring_bytes_sent(4 * params, n, "all_reduce") * steps
        run = {"sync": "diloco", "h": h, "precision": "fp32",
               "bytes": statistics.mean(r["bytes"] for r, _ in pairs)}  # fmt: skip
        ddp_run = {"sync": "ddp", "bytes_per_step": ddp_bytes / steps}
        bw = LINKS["100 Mbit/s"]
        util = steps * compute[n] / modelled(run, compute[n], steps, n, bw)
        ddp_util = steps * compute[n] / modelled(ddp_run, compute[n], steps, n, bw)
        int8 = {**run, "precision": "int8", "bytes": steps // h * ring_bytes_sent(
            encoded_bytes(params, "int8"), n, "all_gather")}  # fmt: skip
        util8 = steps * compute[n] / modelled(int8, compute[n], steps, n, bw)
        # Streaming DiLoCo (4 fragments, 5 steps overlapped): the same bytes a
        # round, plus the last step's flush of the 3 earlier fragments
        rounds = steps // h
        stream = {**run, "fragments": 4, "overlap": 5,
                  "bytes": run["bytes"] * (rounds + 3 / 4) / rounds}  # fmt: skip
        util_s = steps * compute[n] / modelled(stream, compute[n], steps, n, bw)
        spread = max(gaps) - min(gaps)
        need, need8, need_s = (
            compute_for(x, 0.9, steps, n, bw) for x in (run, int8, stream)
        )
        print(
            f"diloco H={h}: {n} centres, {label} data: loss "
            f"{statistics.mean(gaps):+.2f} % against DDP ({seeds}; spread "
            f"{spread:.2f} points), {ddp_bytes / run['bytes']:.0f} x fewer bytes, "
            f"utilisation {100 * util:.1f} % at 100 Mbit/s (DDP "
            f"{100 * ddp_util:.1f} %; with int8 deltas {100 * util8:.1f} %, "
            f"{ddp_bytes / int8['bytes']:.0f} x; streaming 4 fragments, 5 steps "
            f"overlapped {100 * util_s:.1f} %; modelled, loss not run); 90 % "
            f"needs a step of >= {need * 1e3:.0f} ms ({need8 * 1e3:.0f} ms int8, "
            f"{need_s * 1e3:.0f} ms streaming)",
            flush=True,
        )
    honest = [r for r in results if r["sync"] == "diloco"]
    if honest:
        print(
            f"honest deltas over {len(honest)} DiLoCo runs: largest norm "
            f"{max(r['max_norm_ratio'] for r in honest):.2f}x the other centres' "
            f"median (--delta-bound 4), smallest cosine to the run's direction "
            f"{min(r['min_cosine'] for r in honest):.3f} (--delta-min-cosine "
            f"-0.5), {sum(r['refused'] for r in honest)} deltas left out",
            flush=True,
        )


def long_main(args) -> int:
    """``--long``: DiLoCo at H = 100 over 30 outer steps against DDP, at 2
    and 4 centres, shared and non-IID data, over ``--seeds``; runs in
    ``--lanes`` parallel, each result kept in ``--json`` as it ends."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    seq = args.seq
    cfg = load_config("tiny", seq_len=seq)
    docs = 3000
    news, reviews = shards("news", seq, docs), shards("reviews", seq, docs)
    (news_a, news_b), (rev_a, rev_b) = halves("news", seq, docs), halves(
        "reviews", seq, docs)  # fmt: skip
    data = {(2, "shared"): [news], (4, "shared"): [news],
            (2, "non-IID"): [news, reviews],
            (4, "non-IID"): [news_a, rev_a, news_b, rev_b]}  # fmt: skip
    params = sum(p.numel() for p in build_model(cfg, device="meta").parameters())
    print(
        f"# cross-centre, long: PanGu-a tiny ({params / 1e6:.1f} M params), seq "
        f"{seq}, global batch {args.batch}, lr {args.lr:g} (warm-up 100), "
        f"{args.steps} steps, H = {args.inner_steps} ({args.steps // args.inner_steps}"
        f" outer steps, OpenDiLoCo's outer lr 0.7 / momentum 0.9, fp32 deltas), "
        f"seeds {args.seeds}; links modelled at {RTT_S * 1e3:.0f} ms RTT; torch "
        f"{torch.__version__}, {os.cpu_count()} CPUs",
        flush=True,
    )
    compute = {n: step_compute_s(cfg, news, args.batch // n, 40) for n in (2, 4)}
    print(f"# one centre's step alone: {compute[2] * 1e3:.1f} ms (2 centres), "
          f"{compute[4] * 1e3:.1f} ms (4)", flush=True)  # fmt: skip
    results: list[dict] = []
    lock = threading.Lock()
    with tempfile.TemporaryDirectory(prefix="aisyn-xcl-") as tmp:
        model = Path(tmp) / "model.json"
        model.write_text(json.dumps(cfg.to_dict()))

        def one(job):
            r = run_long_job(job, args, Path(tmp), model, data)
            with lock:
                results.append(r)
                if args.json:
                    saved = {"compute": compute, "params": params, "results": results}
                    Path(args.json).write_text(json.dumps(saved))
                print(f"{r['sync']} {r['centres']} centres, {r['data']} data, seed "
                      f"{r['seed']}: valid loss {r['valid_loss']:.4f} "
                      f"({r['box_wall_s']:.0f} s here)", flush=True)  # fmt: skip

        with ThreadPoolExecutor(args.lanes) as pool:
            for f in [pool.submit(one, j) for j in long_jobs(args.seeds, data)]:
                f.result()
    long_summary(results, args, params, compute)
    return 0


def plot(curves: dict, path: Path, steps: int) -> None:
    import logging

    import matplotlib

    matplotlib.use("Agg")
    for name in ("matplotlib", "matplotlib.font_manager"):  # font lookups
        logging.getLogger(name).setLevel(logging.WARNING)
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (name, (points, step_s, centres)) in enumerate(curves.items()):
        if not points:
            continue
        tokens, raw = zip(*points, strict=True)
        # One batch's loss every 10 steps is noisy: a moving average of them,
        # so that the runs can be told apart.
        loss, avg = [], raw[0]
        for x in raw:
            avg = 0.7 * avg + 0.3 * x
            loss.append(avg)
        style = {"label": name, "color": plt.cm.tab20(i % 20),
                 "linestyle": "-" if centres == 2 else "--"}  # fmt: skip
        a.plot(tokens, loss, **style)
        wall = [t / tokens[-1] * steps * step_s / 3600 for t in tokens]
        b.plot(wall, loss, **style)
    a.set_xlabel("tokens (all centres together)")
    b.set_xlabel("modelled wall time at 100 Mbit/s, 50 ms RTT (h)")
    for ax in (a, b):
        ax.set_ylabel("training loss of centre 0 (moving average)")
        ax.grid(alpha=0.3)
    b.set_xscale("log")
    a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
