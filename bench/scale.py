"""The reference's sizes (issue 19): one line per figure.

* ``350M``: seed 000's PanGu-α 350M (16 layers, hidden 1280, seq 1024; the
  vocabulary the data's tokenizer has) trained for a few steps at batch 1,
  split over gRPC on loopback (``aisyn split serve`` and ``aisyn split train
  --mode grpc --insecure``, each its own process) and unsplit (``aisyn
  train``, same seed and data): s/step, tokens/s and each process's peak RSS
  (VmHWM, which it reports as it exits) beside what ``aisyn split plan`` predicts for
  it, and the largest relative split-vs-unsplit loss difference.
* ``bf16``: bf16 autocast against fp32 after 5 steps, unsplit and split
  in-process, on a tiny PanGu-α (10 more steps of 350M would double the
  bench's time); activation checkpointing against none.
* ``plan``: per-rank memory of 2.6B, 13B and 200B on stated device sets.
* pipeline: ``bench/scale_pipeline.py``: B's blocks on 2 and 3 pipeline stages
  (torchrun) against unsplit training, PanGu-α and Llama; the pipeline bubble.
* federated: ``bench/scale_fl.py``'s ``two_rank_client_line``: a 2-rank client
  against a 1-rank one over a chunked round.

``FIGURES`` is the list of figure functions, each returning its lines.

    python bench/scale.py --quick     # 350M: 3 steps of each run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from aisyn.data.corpora import load_corpus
from aisyn.data.shards import prepare
from aisyn.data.tokenizer import PanguTokenizer
from aisyn.model.cost import format_bytes
from aisyn.model.families import load_config, with_vocab
from aisyn.model.memory import Workload
from aisyn.model.pangu import PanguConfig
from aisyn.model.segments import parse_partition
from aisyn.split.client.train import split_train
from aisyn.split.planner import PartySpec, evaluate, plan
from aisyn.split.session import SplitOptions
from aisyn.train.config import TrainConfig
from aisyn.train.memory import party_bytes, whole_model_bytes
from aisyn.train.pretrain import train
from aisyn.train.run import read_metrics

BENCH = Path(__file__).resolve().parent
#: the split-exactness tolerance of tests/split/test_exactness.py
REL = 1e-5
CUT = "u:1,1"


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def seconds_per_step(run: Path) -> float:
    """Mean step time after the first (which pays for allocation)."""
    t = [r["elapsed_s"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else t[0]


def worst_rel(got: list[float], want: list[float]) -> float:
    return max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))


# --- the 350M run ------------------------------------------------------------------


#: runs ``aisyn.cli`` and, as it exits, writes its own VmHWM (KiB) to argv[1].
#: Not ``wait4``'s ``ru_maxrss``: Linux carries the RSS of the image before
#: ``exec`` into it, which is this (large) bench process's.
_REPORTING = (
    "import atexit, sys\n"
    "path = sys.argv.pop(1)\n"
    "def report():\n"
    "    for line in open('/proc/self/status'):\n"
    "        if line.startswith('VmHWM:'):\n"
    "            open(path, 'w').write(line.split()[1])\n"
    "atexit.register(report)\n"
    "from aisyn.cli import main\n"
    "sys.argv[0] = 'aisyn'\n"
    "sys.exit(main())\n"
)


class Child:
    """A CLI process that reports its peak RSS (VmHWM) when it ends."""

    def __init__(self, args: list[str], log: Path, env: dict) -> None:
        self.log = log.open("w")
        self.hwm = log.with_suffix(".hwm")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _REPORTING, str(self.hwm), *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.peak_rss = None

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        self.log.close()
        if self.hwm.is_file():
            self.peak_rss = int(self.hwm.read_text()) * 1024
        return rc

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.log.close()


def tail(path: Path) -> str:
    return " | ".join(path.read_text().strip().splitlines()[-3:])


def measure_350m(
    model: str, steps: int, seq_len: int, root: Path, threads: int
) -> dict:
    """Unsplit, then split over gRPC, ``steps`` steps at batch 1 each; the
    planner's predictions for the same settings (its functions, not copies)."""
    tok = PanguTokenizer.load()
    data = root / "data"
    prepare(load_corpus("news"), tok, seq_len, data, max_documents=300)
    cfg = with_vocab(load_config(model), tok.vocab_size)  # as aisyn train does
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "FLWR_TELEMETRY_ENABLED": "0",
    }
    common = [
        "--model",
        model,
        "--data",
        str(data),
        "--steps",
        str(steps),
        "--batch-size",
        "1",
        "--warmup",
        "1",
        "--lr",
        "1e-4",
        "--log-every",
        "1",
        "--seed",
        "1",
        "--device",
        "cpu",
        "--quiet",
    ]
    out: dict = {"cfg": cfg, "seq_len": seq_len, "steps": steps}
    # Unsplit first, alone on the machine.
    base = Child(
        ["train", "--out", str(root / "unsplit"), *common], root / "u.log", env
    )
    if base.wait(3600):
        raise RuntimeError(f"aisyn train failed: {tail(root / 'u.log')}")
    out["unsplit"] = {
        "losses": losses(root / "unsplit"),
        "s_per_step": seconds_per_step(root / "unsplit"),
        "peak_rss": base.peak_rss,
        "predicted": whole_model_bytes(cfg, 1, seq_len),
    }
    token = root / "token"
    token.write_text("scale-bench-token")
    token.chmod(0o600)
    address = root / "address"
    server = Child(
        [
            "split",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--address-file",
            str(address),
            "--model",
            model,
            "--cut",
            CUT,
            "--out",
            str(root / "b"),
            "--insecure",
            "--token-file",
            str(token),
            "--device",
            "cpu",
            "--exit-after",
            "1",
        ],
        root / "b.log",
        env,
    )
    try:
        deadline = time.monotonic() + 300
        while not address.is_file():
            if server.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"split serve did not start: {tail(root / 'b.log')}")
            time.sleep(0.2)
        a = Child(
            [
                "split",
                "train",
                "--mode",
                "grpc",
                "--peer",
                address.read_text().strip(),
                "--insecure",
                "--token-file",
                str(token),
                "--cut",
                CUT,
                "--out",
                str(root / "a"),
                # undefended: the planner's memory and the unsplit losses are
                # those of the split itself (the default, recommended defence
                # calibrates on the whole model first and noises what crosses)
                "--defence",
                "none",
                *common,
            ],
            root / "a.log",
            env,
        )
        if a.wait(3600):
            raise RuntimeError(
                f"split train failed: {tail(root / 'a.log')}; the compute party: "
                f"{tail(root / 'b.log')}"
            )
        if server.wait(300):
            raise RuntimeError(f"split serve failed: {tail(root / 'b.log')}")
    finally:
        server.stop()
    cut = parse_partition(CUT, cfg)
    out["split"] = {
        "losses": losses(root / "a"),
        "s_per_step": seconds_per_step(root / "a"),
        "peak_rss": {"A": a.peak_rss, "B": server.peak_rss},
        "predicted": {p: party_bytes(cfg, cut, p, 1, seq_len) for p in ("A", "B")},
    }
    return out


def line_350m(args: argparse.Namespace, root: Path) -> list[str]:
    r = measure_350m(args.model, args.steps, args.seq_len, root, args.threads)
    cfg, T = r["cfg"], r["seq_len"]
    u, s = r["unsplit"], r["split"]
    diff = worst_rel(s["losses"], u["losses"])

    def mem(measured: float, predicted: float) -> str:
        err = predicted / measured - 1
        return (
            f"peak RSS {format_bytes(measured)} (plan {format_bytes(predicted)}, "
            f"{100 * err:+.1f} %)"
        )

    seq = "" if T == cfg.seq_len else f" (seq shortened from {cfg.seq_len})"
    return [
        f"{args.model} split over gRPC, cut {CUT}, vocab {cfg.vocab_size} (the "
        f"data's tokenizer), seq {T}{seq}, batch 1, fp32, {r['steps']} steps: "
        f"{s['s_per_step']:.1f} s/step ({T / s['s_per_step']:.0f} tokens/s); "
        f"A {mem(s['peak_rss']['A'], s['predicted']['A'])}; "
        f"B {mem(s['peak_rss']['B'], s['predicted']['B'])}; "
        f"max relative split-vs-unsplit loss difference {diff:.1e} "
        f"({'<=' if diff <= REL else '>'} {REL:g}); unsplit "
        f"{u['s_per_step']:.1f} s/step, {mem(u['peak_rss'], u['predicted'])}"
    ]


# --- bf16 and activation checkpointing ----------------------------------------------

TINY = PanguConfig(
    vocab_size=8000, hidden_size=64, num_layers=5, num_heads=4, ffn_size=256, seq_len=64
)


def _tiny_runs(root: Path, steps: int) -> dict[str, list[float]]:
    tok = PanguTokenizer.load()
    data = root / "tiny-data"
    prepare(load_corpus("news"), tok, 64, data, max_documents=200)
    runs = {}
    for name, extra in {
        "fp32": {},
        "bf16": {"autocast": "bf16"},
        "ckpt": {"activation_checkpointing": True},
    }.items():
        tc = TrainConfig(
            steps=steps,
            batch_size=4,
            micro_batch_size=2,
            lr=3e-3,
            warmup_steps=2,
            log_every=1,
            seed=11,
            device="cpu",
            **extra,
        )
        train(TINY, [data], root / name, tc, progress=False)
        runs[name] = losses(root / name)
        opts = SplitOptions(cut=CUT, mode="local", window=1)
        split_train(TINY, [data], root / f"split-{name}", tc, opts, progress=False)
        runs[f"split-{name}"] = losses(root / f"split-{name}")
    return runs


def line_bf16(args: argparse.Namespace, root: Path) -> list[str]:
    r = _tiny_runs(root, 5)
    rel = abs(r["bf16"][-1] - r["fp32"][-1]) / r["fp32"][-1]
    return [
        f"bf16 autocast vs fp32 after 5 steps (tiny PanGu-a, hidden 64, 4 blocks, "
        f"lr 3e-3; not 350M: 10 more 350M steps would double this bench's time): "
        f"loss {r['bf16'][-1]:.6f} vs {r['fp32'][-1]:.6f} ({rel:.1e} relative); "
        f"split bf16 vs unsplit bf16 max relative difference "
        f"{worst_rel(r['split-bf16'], r['bf16']):.1e}",
        f"activation checkpointing vs none, 5 steps (same tiny model): unsplit "
        f"{worst_rel(r['ckpt'], r['fp32']):.1e}, split "
        f"{worst_rel(r['split-ckpt'], r['fp32']):.1e} max relative loss difference",
    ]


# --- plans of the reference's sizes -----------------------------------------------

#: (model, data party, compute party, workload) of each printed plan. 200B's
#: A on R devices keeps its ends (embedding, ln_f, the top query layer: 3.9e9
#: parameters) whole on each and shares each micro-batch's rows, so it needs
#: 16 devices and micro-batches of 16 rows; B's stages then hold the link's
#: window (what the torchrun compute party runs), not GPipe's 8 x 16 rows.
PLANS = (
    ("2.6B", "A:1:80GB", "B:4:2x80GB", {}),
    ("13B", "A:1:80GB", "B:4:8x80GB", {}),
    (
        "200B",
        "A:1:16x80GB",
        "B:8:61x80GB",
        {"batch_size": 128, "micro_batch_size": 16, "schedule": "window"},
    ),
)


def line_plans(args: argparse.Namespace, root: Path) -> list[str]:
    out = []
    for model, a, b, extra in PLANS:
        cfg = load_config(model)
        w = Workload(
            **{"batch_size": 8, "micro_batch_size": 1, "dtype": "bf16", **extra}
        )
        parties = [PartySpec.parse(a), PartySpec.parse(b)]
        p = plan(model, cfg, parties, w)
        desc = "; ".join(
            f"{spec.split(':')[0]} on {spec.split(':')[2]}: largest rank "
            f"{format_bytes(p.loads[name].largest_rank.memory_bytes)} "
            f"({p.loads[name].largest_rank.describe()})"
            for name, spec in (("A", a), ("B", b))
        )
        ac = ", activation checkpointing" if w.activation_checkpointing else ""
        out.append(
            f"plan {model} ({p.total_params / 1e9:.1f}e9 parameters), bf16 with "
            f"fp32 master, batch {w.batch_size} = {w.micro_batches} micro-batches "
            f"of {w.micro_batch_size} x {p.seq_len}, "
            f"{w.schedule}{ac}, cut {p.partition.spec}: {desc}"
        )
    # and what a device set too small is told
    cfg = load_config("13B")
    w = Workload(batch_size=8, micro_batch_size=1, dtype="bf16")
    parties = {"A": PartySpec.parse("A:1:80GB"), "B": PartySpec.parse("B:4:2x80GB")}
    misfits = evaluate("13B", cfg, parse_partition("u:1,1", cfg), parties, w).misfits()
    out.append(f"plan 13B on B 2 x 80GB, cut u:1,1: refused: {misfits[0]}")
    return out


def line_federated(args: argparse.Namespace, root: Path) -> list[str]:
    sys.path.insert(0, str(BENCH))
    from scale_fl import two_rank_client_line  # bench/scale_fl.py

    return [two_rank_client_line()]


def line_pipeline(args: argparse.Namespace, root: Path) -> list[str]:
    sys.path.insert(0, str(BENCH))
    from scale_pipeline import pipeline_lines  # bench/scale_pipeline.py

    return pipeline_lines(args.quick)


#: one function per figure; each returns its printed lines
FIGURES: list[Callable[[argparse.Namespace, Path], list[str]]] = [
    line_350m,
    line_bf16,
    line_plans,
    line_pipeline,
    line_federated,
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 steps of the 350M runs")
    ap.add_argument("--steps", type=int, default=None, help="350M steps (default 5)")
    ap.add_argument("--model", default="350M", help="the measured model")
    ap.add_argument("--seq-len", type=int, default=None, help="default: the model's")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--only", action="append", help="figure function names to run (repeat)"
    )
    ap.add_argument("--json", default=None, help="also write the lines here")
    ap.add_argument("--workdir", default=None, help="keep the runs here")
    args = ap.parse_args()
    args.steps = args.steps or (3 if args.quick else 5)
    args.seq_len = args.seq_len or load_config(args.model).seq_len
    torch.set_num_threads(args.threads)
    lines = []
    with tempfile.TemporaryDirectory(prefix="aisyn-scale-") as tmp:
        tmp = args.workdir or tmp
        for fig in FIGURES:
            if args.only and fig.__name__ not in args.only:
                continue
            folder = Path(tmp) / fig.__name__
            folder.mkdir(parents=True)
            for line in fig(args, folder):
                print(line, flush=True)
                lines.append(line)
    if args.json:
        Path(args.json).write_text(json.dumps(lines, indent=2))


if __name__ == "__main__":
    main()
