"""Training throughput of our PanGu-α against Hugging Face GPT-2 of the same size.

For each config (tiny, small by default) both models are built from scratch
(no download) with the same width, depth, heads, FFN size, vocabulary and
context, and trained with the same AdamW on the same random token batches.
Each measurement runs in a fresh child process (so peak memory is its own),
with the same number of threads; the two models alternate over several rounds
and the median is reported, which keeps a busy machine from favouring either.

    python bench/train_throughput.py                 # tiny and small, CPU
    python bench/train_throughput.py --configs small --rounds 5 --steps 30

Prints tokens/s, peak training memory (CPU: growth of resident memory during
training; CUDA: peak allocated) and the ratio ours / GPT-2 (goal >= 1.0x);
then per config one line for scripts, with our model's MFU on a GPU (the
cost model's FLOPs per token, ``model/cost.py``, against the device's dense bf16
peak: known for A100/H100/H200, else ``--peak-tflops``)::

    train small on cuda: ours N tok/s, MFU N.N % of N TFLOPS (bf16)
Our model does a little more work than GPT-2 at equal depth: its last layer's
queries come from a separate position embedding (wqe), an extra (T, C) lookup.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import statistics
import sys
import time


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _measure(
    kind: str,
    config: str,
    batch: int,
    steps: int,
    warmup: int,
    threads: int,
    device: str,
    queue,
) -> None:
    import torch

    from aisyn.model.causal_lm import lm_loss
    from aisyn.model.families import build_model, load_config

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = load_config(config)
    dev = torch.device(device)
    if kind == "aisyn":
        model = build_model(cfg, seed=0).to(dev)

        def step_loss(x, y):
            return lm_loss(model(x), y)
    else:
        from transformers import GPT2Config, GPT2LMHeadModel

        hf = GPT2Config(
            vocab_size=cfg.vocab_size,
            n_positions=cfg.seq_len,
            n_embd=cfg.hidden_size,
            n_layer=cfg.num_layers,
            n_head=cfg.num_heads,
            n_inner=cfg.ffn_size,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
            tie_word_embeddings=True,
        )
        model = GPT2LMHeadModel(hf).to(dev)
        model.config._attn_implementation = "sdpa"

        def step_loss(x, y):
            return lm_loss(model(input_ids=x).logits, y)

    model.train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-4, betas=(0.9, 0.95), foreach=False
    )
    g = torch.Generator().manual_seed(1)
    data = torch.randint(
        0, cfg.vocab_size, (warmup + steps, batch, cfg.seq_len + 1), generator=g
    ).to(dev)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if dev.type == "cuda"
        else torch.autocast("cpu", enabled=False)
    )
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rss0 = _rss_mb()  # model, data and imports already resident
    for i in range(warmup + steps):
        if i == warmup:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        x, y = data[i, :, :-1], data[i, :, 1:]
        with autocast:
            loss = step_loss(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    # CPU: growth of the resident set over training (activations, gradients,
    # optimizer state), so the two libraries' import footprints don't count.
    peak = (
        torch.cuda.max_memory_allocated() / 2**20
        if dev.type == "cuda"
        else _peak_rss_mb() - rss0
    )
    queue.put(
        {
            "tokens_per_s": steps * batch * cfg.seq_len / dt,
            "peak_mb": peak,
            "rss_before_mb": rss0,
            "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        }
    )


#: dense bf16 peak (TFLOPS) by a word of ``torch.cuda.get_device_name()``
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def peak_tflops(device: str, given: float | None) -> float | None:
    import torch

    if given is not None or not device.startswith("cuda"):
        return given
    name = torch.cuda.get_device_name(torch.device(device))
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def train_flops_per_token(config: str) -> float:
    """Forward and backward (3x the forward) of every block and the head."""
    from aisyn.model.cost import (
        block_forward_flops_per_token,
        head_forward_flops_per_token,
    )
    from aisyn.model.families import load_config

    cfg = load_config(config)
    forward = cfg.num_layers * block_forward_flops_per_token(cfg, cfg.seq_len)
    return 3.0 * (forward + head_forward_flops_per_token(cfg))


def measure(kind, config, args) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(
        target=_measure,
        args=(
            kind,
            config,
            args.batch_size,
            args.steps,
            args.warmup,
            args.threads,
            args.device,
            q,
        ),
    )
    p.start()
    out = q.get(timeout=1800)
    p.join()
    return out


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["tiny", "small"])
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the device's dense bf16 peak for MFU (default: known GPUs only)",
    )
    args = ap.parse_args(argv)
    peak_tf = peak_tflops(args.device, args.peak_tflops)
    lines = []

    print(
        f"# train throughput: batch {args.batch_size}, {args.steps} timed steps, "
        f"{args.rounds} rounds (median), {args.threads} threads, {args.device}, "
        f"torch {torch.__version__}"
    )
    print(
        "| config | params ours / GPT-2 (M) | ours tok/s | GPT-2 tok/s | ratio "
        "| ours peak MB | GPT-2 peak MB |"
    )
    print("|---|---|---|---|---|---|---|")
    for config in args.configs:
        runs = {"aisyn": [], "gpt2": []}
        for _ in range(args.rounds):
            for kind in ("aisyn", "gpt2"):
                runs[kind].append(measure(kind, config, args))
        med = {
            k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()
        }
        peak = {k: max(r["peak_mb"] for r in v) for k, v in runs.items()}
        params = {k: v[0]["params_m"] for k, v in runs.items()}
        print(
            f"| {config} | {params['aisyn']:.2f} / {params['gpt2']:.2f} "
            f"| {med['aisyn']:,.0f} | {med['gpt2']:,.0f} "
            f"| {med['aisyn'] / med['gpt2']:.2f}x | {peak['aisyn']:,.0f} "
            f"| {peak['gpt2']:,.0f} |"
        )
        sys.stdout.flush()
        mfu = "MFU n/a (no known peak: --peak-tflops)"
        if peak_tf:
            used = med["aisyn"] * train_flops_per_token(config) / 1e12
            mfu = f"MFU {100 * used / peak_tf:.1f} % of {peak_tf:g} TFLOPS"
        bf16 = " (bf16)" if args.device.startswith("cuda") else " (fp32)"
        lines.append(
            f"train {config} on {args.device}: ours {med['aisyn']:,.0f} tok/s, "
            f"{mfu}{bf16}"
        )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
