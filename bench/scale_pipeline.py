"""The compute party as a torchrun job: exactness and pipeline bubble.

* Exactness: B's middle blocks over R = 2 and 3 pipeline stages (torchrun,
  gloo, one thread per rank), the data party in this process over gRPC;
  the largest relative difference of the per-step losses from ``aisyn
  train``'s over 20 steps (fp32), for PanGu-α and Llama.
* Bubble: the median seconds per step of a run with B on one process and on
  R stages (one thread each, A's window R + 1 so that A and every stage can
  be busy at once, alternated runs, the better of two), against the ideal
  ``(m + R - 1) / (m R)`` of a pipeline of R stages over m micro-batches
  (each stage a 1/R share of B's compute, on a device of its own; A's share
  and the link are not in the ideal).

* The data party on 2 ranks (``split.client.data_ranks``): the losses of the data
  party on one process, and of unsplit training, over 20 steps.

    python bench/scale_pipeline.py [--quick] [--only exactness|data|bubble]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from aisyn.data.corpora import load_corpus
from aisyn.data.shards import prepare
from aisyn.data.tokenizer import PanguTokenizer
from aisyn.model.families import load_config
from aisyn.net import free_port
from aisyn.split.client.train import split_train
from aisyn.split.session import SplitOptions
from aisyn.split.transport import LinkSettings
from aisyn.train.config import TrainConfig
from aisyn.train.pretrain import train
from aisyn.train.run import read_metrics

TOKEN = "bench-scale-pipeline"
SIZE = dict(vocab_size=8000, hidden_size=64, num_heads=4, ffn_size=128, seq_len=64)
#: six layers of PanGu-α and five of Llama: cut u:1,1 leaves B three blocks
MODELS = {
    "PanGu-α": {"num_layers": 6, **SIZE},
    "Llama": {
        **load_config("llama-tiny").to_dict(),
        **SIZE,
        "num_layers": 5,
        "head_dim": 16,
        "num_kv_heads": 2,
    },
}


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


class Job:
    """``torchrun --nproc-per-node R -m aisyn.cli split serve``."""

    def __init__(self, work: Path, ranks: int, model: Path) -> None:
        self.address = work / f"address-{time.monotonic_ns()}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run",
             "--nproc-per-node", str(ranks), "--master-port", str(free_port()),
             "-m", "aisyn.cli", "split", "serve", "--listen", "127.0.0.1:0",
             "--address-file", str(self.address), "--model", str(model),
             "--insecure", "--out", str(work / f"b-{time.monotonic_ns()}")],
            # one thread per rank, and one for a single process too
            env={**os.environ, "AISYN_SPLIT_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip

    def __enter__(self) -> LinkSettings:
        deadline = time.monotonic() + 180
        while not self.address.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the compute party did not start")
            time.sleep(0.05)
        return LinkSettings(self.address.read_text().strip(), insecure=True)

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


def split_run(
    work: Path, model: Path, ranks: int, data: Path, cfg: TrainConfig, window: int = 2
):
    """(losses, median seconds per step after the first) of a split run with B
    on ``ranks`` ranks."""
    out = work / f"a-{ranks}-{time.monotonic_ns()}"
    with Job(work, ranks, model) as peer:
        split_train(
            model,
            [data],
            out,
            cfg,
            SplitOptions(cut="u:1,1", mode="grpc", window=window, peer=peer),
            progress=False,
        )
    times = [r["step_time_s"] for r in read_metrics(out / "metrics.jsonl")[1:]]
    return losses(out), statistics.median(times) if times else math.nan


def exactness_lines(work: Path, data: Path) -> list[str]:
    cfg = TrainConfig(steps=20, batch_size=8, micro_batch_size=2, lr=3e-3,
                      warmup_steps=4, log_every=1, seed=11, device="cpu")  # fmt: skip
    lines = []
    for name, fields in MODELS.items():
        model = work / f"{name}.json"
        model.write_text(json.dumps(fields))
        base = work / f"unsplit-{name}"
        train(model, [data], base, cfg, progress=False)
        want = losses(base)
        for ranks in (2, 3):
            got, _ = split_run(work, model, ranks, data, cfg)
            worst = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
            lines.append(
                f"backbone on {ranks} pipeline stages, {name}: max relative loss "
                f"difference vs unsplit {worst:.2e} over {len(got)} steps (fp32, gloo)"
            )
    return lines


def bubble_line(work: Path, data: Path, quick: bool) -> str:
    ranks, m = 2, 4
    fields = {**SIZE, "hidden_size": 384, "ffn_size": 1536, "num_layers": 10}
    model = work / "bubble.json"
    model.write_text(json.dumps(fields))
    cfg = TrainConfig(steps=6 if quick else 20, batch_size=4 * m, micro_batch_size=4,
                      lr=1e-3, log_every=1, seed=1, device="cpu")  # fmt: skip
    # alternated, the better of two each: the box is shared and noisy
    one = staged = math.inf
    window = ranks + 1  # A and every stage busy at once
    for _ in range(2):
        one = min(one, split_run(work, model, 1, data, cfg, window)[1])
        staged = min(staged, split_run(work, model, ranks, data, cfg, window)[1])
    # The form: a stage's step against m micro-batches of its 1/R
    # share of B's compute, ideally (m + R - 1) / m; and the same against B
    # on one process, ideally (m + R - 1) / (m R).
    bubble, ideal = staged / (one / ranks), (m + ranks - 1) / m
    return (
        f"pipeline bubble: B's 7 blocks on {ranks} stages, m={m} micro-batches, "
        f"A's window {window}: {staged:.3f} s/step vs {one:.3f} on one process "
        f"(median step, one thread each): {bubble:.2f}x its compute share's m "
        f"micro-batches (ideal (m+R-1)/m = {ideal:.2f}), {staged / one:.2f}x one "
        f"process (ideal {ideal / ranks:.2f}); A's share, the link and the "
        f"{os.cpu_count()} CPU cores A and the ranks share are not in the ideal"
    )


def data_party_line(work: Path, data: Path) -> str:
    """The data party on 2 ranks (``split.client.data_ranks``: its blocks FSDP2-sharded,
    rows shared), the compute party in rank 0's process: losses against the
    data party on one process and against unsplit training."""
    model = work / "data-ranks.json"
    model.write_text(json.dumps(MODELS["PanGu-α"]))
    cfg = TrainConfig(steps=20, batch_size=8, micro_batch_size=2, lr=3e-3,
                      warmup_steps=4, log_every=1, seed=11, device="cpu")  # fmt: skip
    base = work / "unsplit-data-ranks"
    train(model, [data], base, cfg, progress=False)
    args = [
        "split", "train", "--mode", "local", "--model", str(model), "--cut", "u:2,2",
        "--data", str(data), "--steps", "20", "--batch-size", "8",
        "--micro-batch-size", "2", "--lr", "3e-3", "--warmup", "4",
        "--log-every", "1", "--seed", "11", "--device", "cpu", "--quiet",
        "--defence", "none",  # held to unsplit training's losses: no noise
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {}
    for ranks in (1, 2):
        out = work / f"a-ranks-{ranks}"
        launcher = [sys.executable, "-m", "aisyn.cli"]
        if ranks > 1:
            launcher = [sys.executable, "-m", "torch.distributed.run",
                        "--nproc-per-node", str(ranks), "--master-port",
                        str(free_port()), "-m", "aisyn.cli"]  # fmt: skip
        subprocess.run(
            [*launcher, *args, "--out", str(out)],
            env=env,
            check=True,
            capture_output=True,
            timeout=900,
        )
        runs[ranks] = losses(out)

    def worst(got, want):
        return max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))

    return (
        f"data party on 2 ranks (front and back FSDP2-sharded, rows shared), "
        f"PanGu-α, cut u:2,2: max relative loss difference vs one process "
        f"{worst(runs[2], runs[1]):.2e}, vs unsplit {worst(runs[2], losses(base)):.2e} "
        f"over {len(runs[2])} steps (fp32, gloo)"
    )


def data_dir(work: Path) -> Path:
    out = work / "news"
    prepare(load_corpus("news"), PanguTokenizer.load(), 64, out, max_documents=400,
            corpus_specs=["news"])  # fmt: skip
    return out


def pipeline_lines(quick: bool = True, only: str | None = None) -> list[str]:
    """``only``: ``exactness``, ``bubble`` or ``data`` (default: all)."""
    torch.set_num_threads(1)  # as torchrun gives each rank
    os.environ["AISYN_SPLIT_TOKEN"] = TOKEN  # the one the compute party gets
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = data_dir(work)
        lines = exactness_lines(work, data) if only in (None, "exactness") else []
        if only in (None, "data"):
            lines.append(data_party_line(work, data))
        if only in (None, "bubble"):
            lines.append(bubble_line(work, data, quick))
        return lines


def main() -> None:
    logging.disable(logging.WARNING)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", choices=["exactness", "bubble", "data"])
    args = p.parse_args()
    for line in pipeline_lines(args.quick, args.only):
        print(line, flush=True)


if __name__ == "__main__":
    main()
