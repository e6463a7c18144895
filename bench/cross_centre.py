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

prints, among others, ``diloco H=100: loss N.N % above DDP, N x fewer bytes,
utilisation N % at 100 Mbit/s (DDP N %)``, and writes the loss against
tokens and against modelled wall time to ``--plot`` (default
cross_centre.png). ``--steps``, ``--batch`` (global, all centres together)
and ``--lr`` (the AdamW peak lr of DDP and of DiLoCo's inner steps) change the
budget the runs share; the defaults are 300 / 1 500 steps, 16 and 3e-3.
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
from aisyn.train.diloco import ring_bytes_sent  # noqa: E402
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
    """``aisyn train`` on ``n`` ranks; returns its wall seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(n), "-m", "aisyn.cli", "train", "--quiet",
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
    each = ring_latency(n, op) + run["bytes"] / (exchanges + flush) / bw
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
    args = ap.parse_args(argv)
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
                    f"diloco H={x['h']}{extra}: loss "
                    f"{100 * (x['valid_loss'] / ddp_loss - 1):.1f} % above DDP, "
                    f"{ddp['bytes'] / x['bytes']:.0f} x fewer bytes, utilisation "
                    f"{100 * x['utilisation 100 Mbit/s']:.0f} % at 100 Mbit/s "
                    f"(DDP {100 * ddp['utilisation 100 Mbit/s']:.0f} %) "
                    f"[{n} centres, {label} data]",
                    flush=True,
                )
    plot(curves, Path(args.plot), steps)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
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
