"""Split-vs-unsplit equality per model family: the largest relative
difference between the per-step losses of ``aisyn train`` and ``aisyn split
train`` (in-process, pipelined, 2 micro-batches in flight) over 20 steps.

Small models of each family (4 ordinary blocks, hidden 64; Llama with
grouped-query attention and an untied head, Qwen2 with one key/value head
and a tied head) on the first 400 documents of the news corpus, cut u:1,1,
fp32, with and without the EOD reset (rotary positions restart per
document for Llama/Qwen2).

    python bench/split_exactness.py
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

import torch

from aisyn.data.corpora import load_corpus
from aisyn.data.shards import prepare
from aisyn.data.tokenizer import PanguTokenizer
from aisyn.model.hf import HFConfig
from aisyn.model.pangu import PanguConfig
from aisyn.split.client.train import split_train
from aisyn.split.session import SplitOptions
from aisyn.train.config import TrainConfig
from aisyn.train.pretrain import train
from aisyn.train.run import read_metrics

SIZE = dict(vocab_size=8000, hidden_size=64, num_heads=4, ffn_size=128, seq_len=64)
MODELS = {
    "pangu": PanguConfig(num_layers=5, **SIZE),  # 4 blocks + the top query layer
    "gpt2": HFConfig(
        family="gpt2",
        num_layers=4,
        norm_eps=1e-5,
        activation="gelu_new",
        tie_embeddings=True,
        **SIZE,
    ),
    "llama": HFConfig(family="llama", num_layers=4, num_kv_heads=2, **SIZE),
    "qwen2": HFConfig(
        family="qwen2", num_layers=4, num_kv_heads=1, tie_embeddings=True, **SIZE
    ),
}


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="aisyn-exact-") as tmp:
        root = Path(tmp)
        data = root / "news"
        prepare(
            load_corpus("news"),
            PanguTokenizer.load(),
            64,
            data,
            max_documents=400,
            corpus_specs=["news"],
        )
        print("| family | EOD reset | steps | max relative loss difference |")
        print("|---|---|---|---|")
        for name, cfg in MODELS.items():
            for eod in (False, True):
                tc = TrainConfig(
                    steps=args.steps,
                    batch_size=8,
                    micro_batch_size=2,
                    lr=3e-3,
                    warmup_steps=4,
                    log_every=1,
                    seed=11,
                    device="cpu",
                    eod_reset=eod,
                )
                base, split = root / f"{name}-{eod}-a", root / f"{name}-{eod}-b"
                train(cfg, [data], base, tc, progress=False)
                opts = SplitOptions(cut="u:1,1", mode="local", window=2)
                split_train(cfg, [data], split, tc, opts, progress=False)
                want, got = losses(base), losses(split)
                worst = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
                print(
                    f"| {name} | {'yes' if eod else 'no'} | {len(got)} | {worst:.2e} |"
                )


if __name__ == "__main__":
    main()
