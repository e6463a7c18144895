"""A compute centre serving several data owners (issue 21): memory and
throughput of LoRA tenants on one base, against one tenant alone.

The compute party is ``aisyn split serve --tenants ... --init-from BASE``, a
process of its own; each tenant's data party is ``split_train`` with LoRA on
both parties (``--method lora --compute-method lora``) on a thread of this
process, over plaintext gRPC on loopback with its own token.

* memory: the compute party's peak RSS (VmHWM) over its RSS before any
  session, with 1, 4 and 8 tenants training at once, as a multiple of one
  tenant's; beside it what copies of the base per session would take (the
  planner's estimate of B's weights, times the tenants).
* throughput: the tokens per second of all tenants together, 4 at once
  against one alone on the same box; each tenant's share of the tokens
  against its weight's (all weights 1: a fair share is 1/N), and each
  tenant's p99 step time against its solo one x N / weight.

    python bench/tenants.py --quick
    python bench/tenants.py --device cuda --tenants 1,8   # the device check

On a GPU (``--device cuda``) the compute party's memory is its device memory
as ``nvidia-smi`` reports it, sampled while the tenants train (its peak);
``--tiny`` is a model small enough to check the plumbing in seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from split_efficiency import prepare_data  # noqa: E402

from aisyn.model.cost import format_bytes, module_sizes
from aisyn.model.families import build_model  # noqa: E402
from aisyn.model.memory import Workload, party_load
from aisyn.model.pangu import PanguConfig  # noqa: E402
from aisyn.model.segments import COMPUTE_PARTY, parse_partition  # noqa: E402
from aisyn.net import free_port  # noqa: E402
from aisyn.split.centre.server import adapter_bytes  # noqa: E402
from aisyn.split.centre.tenant_metrics import read_status  # noqa: E402
from aisyn.split.client.train import split_train  # noqa: E402
from aisyn.split.session import SplitOptions  # noqa: E402
from aisyn.split.transport import LinkSettings  # noqa: E402
from aisyn.train.config import TrainConfig  # noqa: E402
from aisyn.train.lora import Method  # noqa: E402
from aisyn.train.pretrain import train  # noqa: E402
from aisyn.train.run import read_metrics  # noqa: E402

CUT = "u:1,1"
LORA = Method("lora", rank=8, alpha=16.0)


def model_config(quick: bool, tiny: bool = False) -> PanguConfig:
    """As at the reference's sizes, B's blocks dominate what a session holds
    at micro-batch 1 (a 2.6B backbone's weights are 8 GiB, one micro-batch's
    activations at seq 1024 a few hundred MiB), so what sharing the base saves
    is what the figure shows; the header prints both for the model here."""
    if tiny:
        return PanguConfig(
            vocab_size=8000,
            hidden_size=64,
            num_layers=4,
            num_heads=4,
            ffn_size=256,
            seq_len=16,
        )
    return PanguConfig(
        vocab_size=8000,
        hidden_size=1024,
        num_layers=10 if quick else 16,
        num_heads=16,
        ffn_size=4096,
        seq_len=64,
    )


def tcfg(steps: int, seed: int, device: str = "cpu") -> TrainConfig:
    return TrainConfig(
        steps=steps,
        batch_size=2,
        micro_batch_size=1,
        lr=1e-3,
        warmup_steps=1,
        log_every=1,
        seed=seed,
        device=device,
        # what a centre serving many sessions would ask of them: only each
        # block's input is kept for backward (B follows the hello)
        activation_checkpointing=True,
    )


def gpu_bytes(pid: int) -> float:
    """Device memory process ``pid`` holds now, as ``nvidia-smi`` reports it."""
    query = "--query-compute-apps=pid,used_memory"
    out = subprocess.run(
        ["nvidia-smi", query, "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    rows = [line.split(",") for line in out.splitlines() if "," in line]
    return sum(float(mib) * 2**20 for p, mib in rows if int(p) == pid)


def rss(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of process ``pid`` in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = float(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


class Centre:
    """``aisyn split serve`` for ``n`` token tenants, in its own process."""

    def __init__(
        self,
        root: Path,
        cfg_json: Path,
        base: Path,
        weights: list[float],
        batch: bool = False,
        device: str = "cpu",
    ) -> None:
        n = len(weights)
        self.device = device
        self.gpu_peak = 0.0
        root.mkdir(parents=True, exist_ok=True)
        self.tokens = []
        lines = []
        for i in range(n):
            token = root / f"t{i}.token"
            token.write_text(f"tenant-{i}-token-{os.getpid()}-0123456789\n")
            self.tokens.append(token)
            lines.append(
                f'[tenant.t{i}]\ntoken_file = "{token.name}"\nweight = {weights[i]}\n'
            )
        (root / "tenants.toml").write_text("".join(lines))
        address = root / "address"
        metrics = f"127.0.0.1:{free_port()}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "FLWR_TELEMETRY_ENABLED": "0"}
        env.update(json.loads(os.environ.get("BENCH_SERVE_ENV", "{}")))
        self.log = (root / "serve.log").open("w")
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "aisyn.cli", "split", "serve",
                "--listen", "127.0.0.1:0", "--model", str(cfg_json), "--cut", CUT,
                "--out", str(root / "b"), "--init-from", str(base), "--insecure",
                "--tenants", str(root / "tenants.toml"), "--max-sessions", str(n),
                "--address-file", str(address), "--device", device,
                "--metrics-listen", metrics,
                *(["--batch-tenants"] if batch else []),
            ],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while not address.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the compute party did not start: {root}/serve.log")
            time.sleep(0.05)
        self.address = address.read_text().strip()
        self.metrics = metrics
        time.sleep(0.5)  # settled: the runtime's memory is what "idle" means
        self.idle_rss = self.sample() if self.on_gpu else rss(self.proc.pid)[0]

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    def sample(self) -> float:
        """On a GPU: the device memory held now (its peak kept)."""
        now = gpu_bytes(self.proc.pid)
        self.gpu_peak = max(self.gpu_peak, now)
        return now

    def peak(self) -> float:
        return self.gpu_peak if self.on_gpu else rss(self.proc.pid)[1]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def compute_seconds(metrics: str) -> dict[str, float]:
    """B's compute seconds per tenant so far, from its metrics endpoint."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5) as r:
        rows = read_status(r.read().decode())
    return {t: row.get("compute_seconds_total", 0.0) for t, row in rows.items()}


def run_tenants(
    root: Path,
    cfg,
    cfg_json: Path,
    base: Path,
    data: Path,
    weights: list[float],
    steps: int,
    batch: bool = False,
    device: str = "cpu",
) -> dict:
    """The tenants at once: the centre's memory, each one's steps, and B's
    compute per tenant while all of them were training (``batch``: the
    centre batches their micro-batches through the base)."""
    n = len(weights)
    centre = Centre(root, cfg_json, base, weights, batch, device)
    runs = [root / f"a{i}" for i in range(n)]
    errors: list[BaseException] = []

    def tenant(i: int) -> None:
        peer = LinkSettings(
            centre.address, token_file=str(centre.tokens[i]), insecure=True
        )
        try:
            split_train(
                cfg,
                [data],
                runs[i],
                tcfg(steps, seed=100 + i, device=device),
                SplitOptions(cut=CUT, mode="grpc", window=2, peer=peer),
                init_from=base,
                method=LORA,
                compute_method=LORA,
                progress=False,
            )
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=tenant, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    contended: dict[str, float] = {}
    try:
        for t in threads:
            t.start()
        # B's compute per tenant up to when the first tenant is done: the
        # stretch in which all of them competed
        while all(t.is_alive() for t in threads):
            contended = compute_seconds(centre.metrics)
            if centre.on_gpu:
                centre.sample()
            time.sleep(0.2)
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        peak = centre.peak()
    finally:
        centre.stop()
    if errors:
        # the compute party's log goes with the bench's temporary folder
        tail = (root / "serve.log").read_text(errors="replace").splitlines()[-40:]
        print("\n".join(tail), file=sys.stderr)
        raise SystemExit(f"a tenant failed: {errors[0]!r}")
    per = []
    for run in runs:
        recs = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
        times = [r["elapsed_s"] for r in recs]
        per.append(
            {
                "step_s": [b - a for a, b in zip(times, times[1:], strict=False)],
                "first_s": times[0],
                "last_s": times[-1],
            }
        )
    return {
        "n": n,
        "held": peak - centre.idle_rss,
        "peak": peak,
        "idle": centre.idle_rss,
        "wall": wall,
        "tenants": per,
        "contended": contended,
        "weights": weights,
    }


def p99(values: list[float]) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, math.ceil(0.99 * len(v)) - 1)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--batch-tenants",
        action="store_true",
        help="the centre runs the tenants' waiting micro-batches through the "
        "base together (aisyn split serve --batch-tenants)",
    )
    ap.add_argument("--device", default="cpu", help="the compute party's and tenants'")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (the plumbing)")
    ap.add_argument(
        "--tenants",
        default="1,4,8",
        help="tenant counts, 1 first (4 among them: the shares and throughput)",
    )
    args = ap.parse_args(argv)
    counts = [int(n) for n in args.tenants.split(",")]
    if counts[0] != 1 or any(n < 2 for n in counts[1:]):
        raise SystemExit("--tenants: 1 first, then counts of 2 or more")
    steps = args.steps or (6 if args.quick else 20)
    torch.set_num_threads(1)
    cfg = model_config(args.quick, args.tiny)
    part = parse_partition(CUT, cfg)
    meta = build_model(cfg, device="meta")
    sizes = dict(meta.named_parameters())
    b_params = sum(sizes[n].numel() for n in part.parameter_names(meta, COMPUTE_PARTY))
    tokens_per_step = tcfg(1, 0).batch_size * cfg.seq_len
    t = tcfg(1, 0)
    work = Workload(
        t.batch_size,
        t.micro,
        seq_len=cfg.seq_len,
        in_flight=t.grad_accum,
        activation_checkpointing=t.activation_checkpointing,
    )
    (load,) = party_load(module_sizes(meta), cfg, part, COMPUTE_PARTY, work).ranks
    adapters = adapter_bytes(cfg, part, LORA)
    # what the compute party's planner says a session holds of its own there
    own = load.activation_bytes + adapters
    print(
        f"# tenants: PanGu-a hidden {cfg.hidden_size}, {cfg.num_layers} layers, "
        f"seq {cfg.seq_len}, cut {CUT} (B: {b_params:,} params, "
        f"{format_bytes(4 * b_params)} fp32; a session's own there "
        f"{format_bytes(own)} by the planner: activations "
        f"{format_bytes(load.activation_bytes)}, adapters with their gradients "
        f"and AdamW moments {format_bytes(adapters)}), "
        f"LoRA rank {LORA.rank} on both "
        f"parties, {steps} steps per tenant at batch {tcfg(1, 0).batch_size}"
        f"{', micro-batches batched across tenants' * args.batch_tenants}; "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.device}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="aisyn-tenants-") as tmp:
        root = Path(tmp)
        data = prepare_data(cfg.seq_len, 2000)
        cfg_json = root / "model.json"
        cfg_json.write_text(json.dumps(cfg.to_dict()))
        base = root / "base"
        train(cfg, [data], base, tcfg(1, seed=7), progress=False)
        results = {}
        for n in counts:
            # four tenants of different weights: their shares of B follow them
            weights = [1.0, 1.0, 2.0, 4.0] if n == 4 else [1.0] * n
            results[n] = run_tenants(
                root / f"n{n}",
                cfg,
                cfg_json,
                base,
                data,
                weights,
                steps,
                args.batch_tenants,
                args.device,
            )
            r = results[n]
            print(
                f"{n} tenant(s): the compute party holds {format_bytes(r['held'])} "
                f"over its idle {format_bytes(r['idle'])} "
                f"(copies of B's blocks per session would add "
                f"{format_bytes(4 * b_params * (n - 1))}), {r['wall']:.1f} s",
                flush=True,
            )
    one = results[1]
    solo_step = statistics.median(one["tenants"][0]["step_s"])

    def throughput(r: dict) -> float:
        return r["n"] * steps * tokens_per_step / r["wall"]

    if 4 in results:
        shares_and_throughput(results[4], solo_step)
    weights = 4.0 * b_params
    for r in (results[n] for n in counts[1:]):
        n = r["n"]
        each = (r["held"] - one["held"]) / (n - 1)
        copies = (one["held"] + (n - 1) * (each + weights)) / one["held"]
        print(
            f"memory with {n} tenants: {r['held'] / one['held']:.2f}x one tenant "
            f"(goal <= 1.25x; each more tenant adds {format_bytes(each)} of "
            f"its own, {each / own:.2f}x the planner's {format_bytes(own)}; a "
            f"copy of the base per tenant would make it {copies:.2f}x)"
        )
    if 4 in results:
        print(
            f"throughput with 4 tenants: "
            f"{throughput(results[4]) / throughput(one):.2f}x one tenant (goal >= 1.0x)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def shares_and_throughput(four: dict, solo_step: float) -> None:
    """B's compute shares of 4 tenants of different weights, and their p99 step."""
    used = four["contended"]
    total = sum(used.values()) or math.nan
    wsum = sum(four["weights"])
    shares = [
        (used.get(f"t{i}", 0.0) / total) / (w / wsum)
        for i, w in enumerate(four["weights"])
    ]
    worst_p99 = max(p99(t["step_s"]) for t in four["tenants"])
    print(
        f"B's compute while 4 tenants of weights "
        f"{', '.join(f'{w:g}' for w in four['weights'])} all trained, as a multiple "
        f"of each one's weighted share: {', '.join(f'{x:.2f}' for x in shares)} "
        f"(goal: within 20 %); p99 step {worst_p99:.3f} s against solo "
        f"{solo_step:.3f} s x 4 = {4 * solo_step:.3f} s (goal <= 2x that)"
    )


if __name__ == "__main__":
    sys.exit(main())
