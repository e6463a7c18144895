"""Round cost of federated fine-tuning: non-training time and bytes, full vs LoRA.

Measures, on this machine, real federated runs through Flower's deployment
runtime on loopback (two clients, ``--rounds`` rounds of one local step, so
the round is almost all overhead) for two model sizes and both methods, plus
per-gigabyte costs of what grows with the model (serialising, decoding and
checking, aggregating arrays). Then extrapolates the per-round non-training
time to PanGu-α 2.6B on a stated link speed, next to the reference's 0.618 h.

    python bench/fl_round_cost.py --out /tmp/round_cost

Prints the tables (Markdown) and writes OUT/round_cost.json. Timings are wall
clock on whatever else the machine is running; say so when quoting them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from aisyn.data.tokenizer import PanguTokenizer
from aisyn.fl.launch import simulate
from aisyn.fl.records import decode_checked, expected_spec, tensors_to_record
from aisyn.fl.settings import FLSettings
from aisyn.model.families import build_model
from aisyn.model.pangu import CONFIGS, PanguConfig
from aisyn.testbed.inputs import cached_sft
from aisyn.testbed.presets import Preset
from aisyn.train import checkpoint as ckpt
from aisyn.train.run import RunDir

REFERENCE_ROUND_OVERHEAD_S = 0.618 * 3600

MODELS = {
    "tiny": dict(CONFIGS["tiny"], seq_len=64),
    "wide": dict(
        vocab_size=8000,
        hidden_size=512,
        num_layers=6,
        num_heads=8,
        ffn_size=2048,
        seq_len=64,
    ),
}


def make_base(path: Path, cfg: PanguConfig, tok: PanguTokenizer) -> Path:
    """A base run folder with random weights (cost does not depend on them)."""
    if (path / "checkpoints" / "latest").is_file():
        return path
    run = RunDir(path)
    run.create(
        {"kind": "train", "model": cfg.to_dict(), "tokenizer": tok.info()}, resume=False
    )
    run.copy_tokenizer(tok.path)
    model = build_model(cfg, seed=0)
    ckpt.save(run.checkpoints, 0, {ckpt.MODEL_FILE: ckpt.unique_state_dict(model)}, {})
    return path


def lora_params(cfg: PanguConfig, rank: int) -> int:
    """Adapter parameters: A (r x in) and B (out x r) on q, k, v, c_proj and the
    MLP's c_fc, c_proj of every block (as ``aisyn.train.lora`` targets them)."""
    h, f = cfg.hidden_size, cfg.ffn_size
    per_layer = 4 * rank * (h + h) + rank * (h + f) + rank * (f + h)
    return cfg.num_layers * per_layer


def full_params(cfg: PanguConfig) -> int:
    return build_model(cfg, device="meta").num_parameters()


def run_rounds(base: Path, sft: dict, out: Path, method: str, rounds: int) -> dict:
    settings = FLSettings.from_dict(
        dict(
            rounds=rounds,
            local_steps=1,
            batch_size=4,
            lr=1e-4,
            warmup=0,
            method=method,
            eval_items=8,
            min_clients=len(sft),
            round_timeout=900,
        )
    )
    result = simulate(base, sft, out, settings)
    rows = []
    for h in result["history"]:
        train = h["client_train_s"]
        rows.append(
            {
                "round": h["round"],
                "round_s": h["wait_s"] + h["aggregate_s"],
                "client_train_s": train,
                "non_training_s": h["wait_s"] + h["aggregate_s"] - train,
                "client_startup_s": h["client_startup_s"],
                "client_load_s": h["client_load_s"],
                "aggregate_s": h["aggregate_s"],
                "bytes_down": h["bytes_sent"],
                "bytes_up": h["bytes_received"],
            }
        )
    return {
        "rounds": rows,
        "payload_per_client": result["payload_bytes_per_client"],
        "trainable": result["trainable_parameters"],
        "wall_s": result["wall_s"],
    }


def per_gb_costs(mb: int = 256, clients: int = 2) -> dict:
    """Seconds per GB of fp32 payload: serialise, decode + check, FedAvg."""
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    n = mb * (1 << 20) // 4
    tensors = {f"t{i}": torch.randn(n // 8) for i in range(8)}
    gb = n * 4 / 1e9
    t = time.perf_counter()
    records = [tensors_to_record(tensors) for _ in range(clients)]
    serialise = (time.perf_counter() - t) / clients / gb
    spec = expected_spec(records[0])
    t = time.perf_counter()
    for r in records:
        decode_checked(r, spec)
    check = (time.perf_counter() - t) / clients / gb
    from flwr.app import MetricRecord, RecordDict

    contents = [
        RecordDict({"arrays": r, "metrics": MetricRecord({"num-examples": 1})})
        for r in records
    ]
    t = time.perf_counter()
    aggregate_arrayrecords(contents, "num-examples")
    aggregate = (time.perf_counter() - t) / gb  # for all clients' copies of 1 GB
    return {
        "serialise_s_per_gb": serialise,
        "decode_check_s_per_gb": check,
        "fedavg_s_per_gb_all_clients": aggregate,
        "measured_mb": mb,
    }


def load_cost_per_gb(mb: int = 256) -> float:
    """Seconds per GB to read a safetensors checkpoint (from the page cache, as
    every round after the first does) and copy it into a model's tensors."""
    import tempfile

    from safetensors.torch import save_file

    n = mb * (1 << 20) // 4
    tensors = {f"t{i}": torch.randn(n // 8) for i in range(8)}
    targets = {k: torch.empty_like(v) for k, v in tensors.items()}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "w.safetensors"
        save_file(tensors, str(path))
        ckpt.read_tensors(path)  # warm the page cache
        t = time.perf_counter()
        loaded = ckpt.read_tensors(path)
        for k, v in loaded.items():
            targets[k].copy_(v)
        return (time.perf_counter() - t) / (n * 4 / 1e9)


def extrapolate(measured: dict, costs: dict, link_gbps: list[float], rank: int) -> list:
    """Per-round non-training time for 2.6B, two clients, server link shared."""
    cfg = PanguConfig(**{**CONFIGS["2.6B"]})
    # polling, process start, imports: independent of the model's size
    fixed = statistics.median(
        r["non_training_s"] - r["client_load_s"]
        for m in measured.values()
        for r in m["rounds"]
    )
    # what loading costs besides reading weights (peft import, data, checks)
    load_fixed = {
        method: statistics.median(
            max(
                0.0, r["client_load_s"] - m["ckpt_bytes"] / 1e9 * costs["load_s_per_gb"]
            )
            for m in measured.values()
            if m["method"] == method
            for r in m["rounds"]
        )
        for method in ("full", "lora")
    }
    out = []
    for method, params in (
        ("full", full_params(cfg)),
        ("lora", lora_params(cfg, rank)),
    ):
        payload = params * 4  # fp32 on the wire
        gb = payload / 1e9
        base_gb = full_params(cfg) * 4 / 1e9  # fp32 base checkpoint, every round
        for gbps in link_gbps:
            transfer = 2 * 2 * payload * 8 / (gbps * 1e9)  # down + up, 2 clients
            compute = (
                gb * costs["serialise_s_per_gb"] * 2  # server out, client reply
                + gb * costs["decode_check_s_per_gb"] * 2  # client in, server check
                + gb * costs["fedavg_s_per_gb_all_clients"]
            )
            load = load_fixed[method] + base_gb * costs["load_s_per_gb"]
            total = fixed + load + transfer + compute
            out.append(
                {
                    "method": method,
                    "params_sent": params,
                    "payload_gb": gb,
                    "link_gbps": gbps,
                    "fixed_s": fixed,
                    "base_load_s": load,
                    "transfer_s": transfer,
                    "serialise_check_aggregate_s": compute,
                    "total_s": total,
                    "vs_reference": total / REFERENCE_ROUND_OVERHEAD_S,
                }
            )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default="tiny,wide")
    ap.add_argument("--link-gbps", default="1,10")
    ap.add_argument("--lora-rank", type=int, default=8)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = PanguTokenizer.load()
    data_preset = Preset(
        name="round-cost",
        seq_len=64,
        max_documents=2000,
        per_document=2,
        test_per_document=1,
    )
    sft = {d: cached_sft(d, tok, data_preset) for d in ("news", "reviews")}
    measured: dict = {}
    for name in args.models.split(","):
        cfg = PanguConfig(**MODELS[name])
        base = make_base(out / f"base-{name}", cfg, tok)
        ckpt_bytes = (
            (ckpt.latest(base / "checkpoints") / ckpt.MODEL_FILE).stat().st_size
        )
        for method in ("full", "lora"):
            run = out / f"run-{name}-{method}-{int(time.time())}"
            print(f"running {name} / {method} ...", file=sys.stderr, flush=True)
            measured[f"{name}/{method}"] = {
                **run_rounds(base, sft, run, method, args.rounds),
                "model": name,
                "method": method,
                "ckpt_bytes": ckpt_bytes,
                "params": full_params(cfg),
            }
    costs = {**per_gb_costs(), "load_s_per_gb": load_cost_per_gb()}
    extra = extrapolate(
        measured, costs, [float(x) for x in args.link_gbps.split(",")], args.lora_rank
    )
    report = {
        "measured": measured,
        "per_gb": costs,
        "extrapolated_2.6B": extra,
        "reference_round_overhead_s": REFERENCE_ROUND_OVERHEAD_S,
    }
    (out / "round_cost.json").write_text(json.dumps(report, indent=2))

    print("## Measured per round (2 clients, loopback, this machine)\n")
    print(
        "| model / method | params | sent per client | round | client train | "
        "non-training | of which start-up | base load | aggregate |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for key, m in measured.items():
        rs = m["rounds"]
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(
            f"| {key} | {m['params'] / 1e6:.2f} M | "
            f"{m['payload_per_client'] / 1e6:.2f} MB each way | {med['round_s']:.1f} s "
            f"| {med['client_train_s']:.1f} s | {med['non_training_s']:.1f} s | "
            f"{med['client_startup_s']:.1f} s | {med['client_load_s']:.2f} s | "
            f"{med['aggregate_s'] * 1e3:.0f} ms |"
        )
    print(
        f"\nPer GB of fp32 payload: serialise {costs['serialise_s_per_gb']:.2f} s, "
        f"decode + check {costs['decode_check_s_per_gb']:.2f} s, FedAvg of "
        f"2 clients {costs['fedavg_s_per_gb_all_clients']:.2f} s.\n"
    )
    print("## Extrapolated to PanGu-α 2.6B, 2 clients, per round\n")
    print(
        "| method | sent per client each way | link | fixed | base load | transfer | "
        "serialise+check+aggregate | total | reference |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for e in extra:
        print(
            f"| {e['method']} | {e['payload_gb']:.2f} GB | {e['link_gbps']:g} Gbit/s | "
            f"{e['fixed_s']:.0f} s | {e['base_load_s']:.0f} s | "
            f"{e['transfer_s']:.0f} s | "
            f"{e['serialise_check_aggregate_s']:.0f} s | {e['total_s'] / 60:.1f} min | "
            f"0.618 h = {REFERENCE_ROUND_OVERHEAD_S / 60:.0f} min |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
