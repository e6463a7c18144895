"""What ``--data-parallel fsdp`` saves: a rank's peak memory against DDP's.

The same ``aisyn train`` run under torchrun (gloo, this box's CPUs) with DDP
(a replica of the weights, gradients and AdamW moments on every rank) and
with FSDP2 (a shard of each), a few steps each; reported per run:

* each rank's peak resident memory (``VmHWM``, read from /proc while it
  runs), and the same for a one-rank run of a model of almost no weights:
  the process's own floor (torch, the data, the tokenizer), so that what
  the model costs shows. Rank 0 also gathers every checkpoint whole in host
  memory (the files DDP writes); the other ranks only train. Every run
  gets ``MALLOC`` (below): on CPU, glibc's defaults keep what FSDP2 frees;
* the step time (the run's own clock, its later steps);
* the losses, which must agree to 1e-5 (the run stops otherwise).

    python bench/fsdp_memory.py --quick

prints ``fsdp: peak N MB per rank vs DDP N MB (N x less above the floor of
N MB; rank 0 ...), step time N x DDP's [R ranks, N M params]`` (Linux).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cross_centre import shards  # noqa: E402

from aisyn.model.families import build_model, load_config  # noqa: E402
from aisyn.train.run import read_metrics  # noqa: E402

#: glibc's malloc: one arena, and freed memory handed back to the kernel.
#: With its defaults (an arena per thread, gloo's threads included) a CPU
#: rank keeps the buffers FSDP2 frees -- each block's gathered weights and
#: gradients -- and its resident memory grows step by step to DDP's; with
#: these it stays at what the rank holds. Both runs get them.
MALLOC = {"MALLOC_ARENA_MAX": "1", "MALLOC_TRIM_THRESHOLD_": "0"}


def rank_peaks(root: int) -> dict[int, float]:
    """Peak resident MB (``VmHWM``) of each rank under process ``root``,
    by its ``RANK``."""
    out = {}
    for pid in _descendants(root):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = next(int(e[5:]) for e in env if e.startswith(b"RANK="))
            status = Path(f"/proc/{pid}/status").read_text()
        except (OSError, StopIteration, ValueError):
            continue  # not a rank, or gone
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                out[rank] = int(line.split()[1]) / 1024
    return out


def _descendants(pid: int) -> list[int]:
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [d for k in map(int, kids) for d in (k, *_descendants(k))]


def run(
    ranks: int, model: Path, data: Path, out: Path, args: list[str]
) -> tuple[dict[int, float], list[float], float]:
    """(each rank's peak resident MB, the losses, seconds per step)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(ranks), "-m", "aisyn.cli", "train", "--quiet",
        "--model", str(model), "--data", str(data), "--out", str(out), *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", **MALLOC}
    with open(out.parent / f"{out.name}.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        peaks: dict[int, float] = {}
        while proc.poll() is None:  # a rank's peak only grows: the last read
            peaks.update(rank_peaks(proc.pid))
            time.sleep(0.05)
    if proc.returncode != 0 or len(peaks) != ranks:
        text = (out.parent / f"{out.name}.log").read_text()
        raise SystemExit(f"{out}: rc {proc.returncode}, {text[-3000:]}")
    recs = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    times = [r["elapsed_s"] for r in recs]
    per_step = (times[-1] - times[1]) / (len(times) - 2)
    return peaks, [r["loss"] for r in recs], per_step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    args = ap.parse_args(argv)
    hidden = args.hidden or (768 if args.quick else 1024)
    layers = args.layers or (8 if args.quick else 12)
    steps = 5 if args.quick else 10
    seq = 64
    cfg = load_config(
        "small", hidden_size=hidden, ffn_size=4 * hidden, num_layers=layers,
        num_heads=hidden // 64, seq_len=seq,
    )  # fmt: skip
    params = sum(p.numel() for p in build_model(cfg, device="meta").parameters())
    data = shards("news", seq, 3000)
    print(
        f"# fsdp memory: PanGu-a hidden {hidden}, {layers} layers "
        f"({params / 1e6:.1f} M params, {16 * params / 1e6:.0f} MB of fp32 "
        f"weights, gradients and AdamW moments), seq {seq}, batch "
        f"{2 * args.ranks}, {steps} steps, {args.ranks} ranks on "
        f"{os.cpu_count()} CPUs (gloo)",
        flush=True,
    )
    common = ["--steps", str(steps), "--batch-size", str(2 * args.ranks),
              "--lr", "1e-4", "--warmup", "1", "--log-every", "1",
              "--seed", "1"]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="aisyn-fsdp-") as tmp:
        model = Path(tmp) / "model.json"
        model.write_text(json.dumps(cfg.to_dict()))
        floor_model = Path(tmp) / "floor.json"
        tiny = load_config("small", hidden_size=64, ffn_size=256, num_layers=2,
                           num_heads=1, seq_len=seq)  # fmt: skip
        floor_model.write_text(json.dumps(tiny.to_dict()))
        floor_peaks, _, _ = run(1, floor_model, data, Path(tmp) / "floor", common)
        floor = floor_peaks[0]
        results = {}
        for parallel in ("ddp", "fsdp"):
            out = Path(tmp) / parallel
            results[parallel] = run(
                args.ranks, model, data, out,
                [*common, "--data-parallel", parallel],
            )  # fmt: skip
            peaks, losses, step_s = results[parallel]
            print(
                f"{parallel}: peak "
                + ", ".join(f"rank {r} {mb:.0f} MB" for r, mb in sorted(peaks.items()))
                + f" (rank 0 writes the checkpoints); {step_s:.3f} s per step, "
                f"final loss {losses[-1]:.5f}",
                flush=True,
            )
    (ddp, ddp_loss, ddp_s), (fsdp, fsdp_loss, fsdp_s) = (
        results["ddp"],
        results["fsdp"],
    )
    worst = max(abs(a / b - 1) for a, b in zip(fsdp_loss, ddp_loss, strict=True))
    if worst > 1e-5:
        raise SystemExit(f"fsdp's losses differ from ddp's by {worst:.2e} (> 1e-5)")
    print(f"# one-rank floor (a 2-layer hidden-64 model): peak {floor:.0f} MB")
    # a rank that trains only: rank 0 also gathers the whole checkpoint
    last = args.ranks - 1
    print(
        f"fsdp: peak {fsdp[last]:.0f} MB per rank vs DDP {ddp[last]:.0f} MB "
        f"({(ddp[last] - floor) / (fsdp[last] - floor):.2f} x less above the "
        f"floor of {floor:.0f} MB; rank 0, which gathers each checkpoint, "
        f"{fsdp[0]:.0f} MB vs {ddp[0]:.0f} MB), step time {fsdp_s / ddp_s:.2f} x "
        f"DDP's [{args.ranks} ranks, {params / 1e6:.0f} M params]; losses within "
        f"{worst:.1e}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
