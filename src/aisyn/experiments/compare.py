"""``aisyn experiment compare``: standalone vs fusion vs federated, as the reference.

1. Token shards of each domain's raw text and a common *base model* pretrained
   on both (our stand-in for pretrained PanGu-α) — built once, cached under
   ``cache_dir("base_models")`` keyed by preset, model, data and tokenizer.
2. Supervised cloze items of each domain's train documents (``prepare_sft``;
   cached), loss on the answer tokens only.
3. Fine-tune the base, with the same budget of optimizer steps, as
   standalone(d) for each domain, fusion(all domains pooled) and federated
   (one client per domain, through Flower's runtime on loopback).
4. Score the untuned base (``lm`` format) and every fine-tuned model (``prompt``
   format, as trained) on each domain's test items, and its LM loss on each
   domain's raw test text; write the reference's table as Markdown and CSV,
   the targets as a table, a chart of every regime's accuracy per domain, the
   per-node loss curves and ``report.json`` into one folder.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aisyn.data.cache import cache_dir
from aisyn.data.corpora import BUILTIN_CORPORA, load_corpus
from aisyn.data.sft import SFTData, prepare_sft
from aisyn.data.shards import TokenShards, prepare, read_manifest
from aisyn.data.tokenizer import PanguTokenizer
from aisyn.eval.cloze import encode_items, encoded_accuracy
from aisyn.experiments.accuracy_chart import plot_accuracy
from aisyn.experiments.presets import Preset
from aisyn.fl.settings import FLSettings
from aisyn.model.causal_lm import CausalLM
from aisyn.model.families import ModelConfig, config_from_dict
from aisyn.train.config import TrainConfig
from aisyn.train.device import resolve_device
from aisyn.train.finetune import finetune
from aisyn.train.lora import Method
from aisyn.train.models import load_run_model
from aisyn.train.objective import evaluate_loss
from aisyn.train.pretrain import train
from aisyn.train.run import read_metrics, write_json_atomic

log = logging.getLogger("aisyn.experiments")

REPORT_MD = "report.md"
REPORT_CSV = "report.csv"
REPORT_JSON = "report.json"
ACCURACY_PNG = "accuracy.png"


def _key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


# --- cached inputs ------------------------------------------------------------------


def cached_shards(domain: str, tok: PanguTokenizer, preset: Preset) -> Path:
    """Raw-text token shards of one domain (seq_len of the preset)."""
    key = _key(["shards/1", domain, tok.sha256, preset.seq_len, preset.max_documents])
    path = cache_dir("experiments", "shards") / f"{Path(domain).stem}-{key}"
    if not (path / "manifest.json").is_file():
        log.info("preparing %s token shards in %s", domain, path)
        prepare(
            load_corpus(domain),
            tok,
            preset.seq_len,
            path,
            max_documents=preset.max_documents,
            overwrite=True,
            corpus_specs=[domain],
        )
    return path


def cached_sft(domain: str, tok: PanguTokenizer, preset: Preset) -> Path:
    key = _key(
        [
            "sft/2",
            domain,
            tok.sha256,
            preset.seq_len,
            preset.per_document,
            preset.test_per_document,
            preset.max_documents,
            preset.seed,
        ]
    )
    path = cache_dir("experiments", "sft") / f"{Path(domain).stem}-{key}"
    if not (path / "manifest.json").is_file():
        log.info("building %s supervised cloze items in %s", domain, path)
        prepare_sft(
            load_corpus(domain),
            tok,
            preset.seq_len,
            path,
            per_document=preset.per_document,
            test_per_document=preset.test_per_document,
            seed=preset.seed,
            max_documents=preset.max_documents,
            corpus_specs=[domain],
            overwrite=True,
        )
    return path


def base_model_config(preset: Preset, tok: PanguTokenizer) -> ModelConfig:
    return config_from_dict(
        {**preset.model, "vocab_size": tok.vocab_size, "seq_len": preset.seq_len}
    )


def cached_base(
    preset: Preset, shards: Sequence[Path], tok: PanguTokenizer, device: str
) -> Path:
    """The base model pretrained on all domains' raw train text; built once.

    An interrupted build resumes from its last checkpoint.
    """
    mcfg = base_model_config(preset, tok)
    cfg = preset.pretrain_config()
    data_hashes = [
        [s["sha256"] for s in read_manifest(d)["splits"]["train"]["shards"]]
        for d in shards
    ]
    key = _key(["base/1", mcfg.to_dict(), cfg.to_dict(), data_hashes, tok.sha256])
    path = cache_dir("base_models") / f"{preset.name}-{key}"
    done = path / "base.json"
    if done.is_file():
        return path
    log.info("pretraining the base model (%d steps) in %s", cfg.steps, path)
    cfg.ckpt_every = max(1, cfg.steps // 10)
    cfg.device = device
    summary = train(
        mcfg,
        [str(d) for d in shards],
        path,
        cfg,
        resume=(path / "config.json").is_file(),
        progress=False,
    )
    write_json_atomic(done, summary)
    return path


# --- evaluation -------------------------------------------------------------------


@dataclass
class Evaluator:
    """Scores models on every domain's test items and test text; encodes once."""

    domains: Sequence[str]
    sft: dict[str, Path]
    shards: dict[str, Path]
    tok: PanguTokenizer
    seq_len: int
    max_items: int | None
    device: torch.device
    _encoded: dict = field(default_factory=dict)

    def encoded(self, domain: str, fmt: str):
        if (domain, fmt) not in self._encoded:
            items = SFTData.open(self.sft[domain], "train", verify=False).test_items()
            items = items[: self.max_items] if self.max_items else items
            self._encoded[domain, fmt] = encode_items(
                items, self.tok, self.seq_len, fmt
            )
        return self._encoded[domain, fmt]

    def __call__(self, model: CausalLM, fmt: str) -> dict:
        model = model.to(self.device).eval()
        out: dict = {"format": fmt}
        for d in self.domains:
            out[f"acc_{d}"] = encoded_accuracy(
                model,
                self.encoded(d, fmt),
                fmt=fmt,
                pad_id=self.tok.pad_id,
                device=self.device,
            )
            test = TokenShards.open(self.shards[d], "test", verify=False)
            out[f"loss_{d}"] = evaluate_loss(
                model, test, batch_size=16, device=self.device
            )
        return out


def _final_loss(metrics_path: Path, key: str = "loss", last: int = 10) -> float | None:
    """Mean of the last ``last`` logged training losses (one step is noisy)."""
    vals = [r[key] for r in read_metrics(metrics_path) if key in r]
    return sum(vals[-last:]) / len(vals[-last:]) if vals else None


# --- the comparison ---------------------------------------------------------------


@dataclass
class Inputs:
    """Everything the regimes share: domains, cached base and data, evaluator."""

    names: list[str]
    base: Path
    base_build_s: float
    shards: dict[str, Path]
    sft: dict[str, Path]
    evaluate: Evaluator
    device: torch.device

    @property
    def device_label(self) -> str:
        if self.device.type == "cpu":
            n = torch.get_num_threads()
            return f"CPU ({n} thread{'s' if n != 1 else ''})"
        return torch.cuda.get_device_name(self.device)


def prepare_inputs(domains: Sequence[str], preset: Preset, device: str) -> Inputs:
    domains = list(domains)
    if len(domains) < 2 or len(set(domains)) != len(domains):
        raise ValueError(f"--domains needs two or more distinct domains, got {domains}")
    for d in domains:
        if d not in BUILTIN_CORPORA and not Path(d).is_file():
            raise ValueError(f"domain {d!r}: not a built-in corpus nor a file")
    names = [Path(d).stem for d in domains]
    dev = resolve_device(device)
    tok = PanguTokenizer.load()
    shards = {
        n: cached_shards(d, tok, preset) for n, d in zip(names, domains, strict=True)
    }
    t0 = time.perf_counter()
    base = cached_base(preset, list(shards.values()), tok, device)
    base_build_s = time.perf_counter() - t0
    sft = {n: cached_sft(d, tok, preset) for n, d in zip(names, domains, strict=True)}
    evaluate = Evaluator(
        names, sft, shards, tok, preset.seq_len, preset.max_test_items, dev
    )
    return Inputs(names, base, base_build_s, shards, sft, evaluate, dev)


def federated_settings(
    preset: Preset, clients: int, device: str, **overrides
) -> FLSettings:
    """The preset's federated settings (equal step budget), then ``overrides``."""
    d = dict(
        rounds=preset.rounds,
        local_steps=preset.local_steps(clients),
        batch_size=preset.batch_size,
        lr=preset.lr,
        min_lr=preset.min_lr,
        warmup=preset.warmup,
        weight_decay=preset.weight_decay,
        seed=preset.seed,
        schedule=preset.schedule,
        method=preset.method,
        strategy=preset.strategy,
        proximal_mu=preset.proximal_mu,
        server_momentum=preset.server_momentum,
        eta=preset.eta,
        min_clients=clients,
        eval_items=preset.eval_items,
        device=device,
    )
    d.update(overrides)
    if "rounds" in overrides and "local_steps" not in overrides:
        d["local_steps"] = preset.finetune_steps // clients // d["rounds"]
    return FLSettings.from_dict(d)


def run_compare(
    domains: Sequence[str],
    preset: Preset,
    out: str | Path,
    *,
    device: str = "auto",
    echo: bool = False,
    tensorboard: bool = False,
    federated: dict | None = None,
) -> dict:
    """Every regime of the comparison in ``out``; ``tensorboard``: each
    fine-tuning run, the federated server and its clients also write
    TensorBoard event files; ``federated``: federated settings by name (e.g.
    secure-aggregation, dp), over the preset's."""
    t_start = time.perf_counter()
    out = Path(out)
    if (out / REPORT_JSON).exists() or (out / "runs").exists():
        raise FileExistsError(
            f"{out}: holds an earlier comparison; choose another --out"
        )
    inputs = prepare_inputs(domains, preset, device)
    names, base, sft = inputs.names, inputs.base, inputs.sft
    runs = out / "runs"
    runs.mkdir(parents=True)
    dev, evaluate, device_label = inputs.device, inputs.evaluate, inputs.device_label
    base_build_s = inputs.base_build_s
    rows: list[dict] = []

    def add_row(regime: str, model: CausalLM, fmt: str, **info) -> None:
        t = time.perf_counter()
        scores = evaluate(model, fmt)
        rows.append(
            {
                "regime": regime,
                "device": device_label,
                **info,
                **scores,
                "eval_s": time.perf_counter() - t,
            }
        )
        log.info("%s: %s", regime, json.dumps(_brief(rows[-1], names)))

    # untuned base
    base_model, base_cfg = load_run_model(base, dev)
    base_summary = json.loads((base / "base.json").read_text())
    add_row(
        "without ft (base)",
        base_model,
        "lm",
        epochs_or_rounds="-",
        steps=0,
        wall_s=None,
        final_loss=None,
        note=f"base pretrained {base_summary['steps']} steps, LM loss "
        f"{base_summary['final_loss']:.3f}",
    )
    del base_model

    method = Method(preset.method)
    cfg = preset.finetune_config()
    cfg.device = device
    plots: dict[str, Path] = {}

    def finetuned(name: str, data: list[Path]) -> None:
        run = runs / name.replace("+", "_")
        summary = finetune(
            base, data, run, cfg, method, progress=False, tensorboard=tensorboard
        )
        model, _ = load_run_model(run, dev)
        add_row(
            f"{name} ft",
            model,
            "prompt",
            epochs_or_rounds=f"{summary['epochs']:.2f} ep",
            steps=summary["steps"],
            wall_s=summary["elapsed_s"],
            final_loss=_final_loss(run / "metrics.jsonl"),
            run=str(run),
        )
        plots[name] = run / "loss.png"

    for n in names:
        finetuned(n, [sft[n]])
    finetuned("+".join(names), [sft[n] for n in names])
    if method.name == "full":  # split fine-tuning trains every weight
        for n in names:
            add_row(**split_finetuned(n, base, base_cfg, sft[n], runs, cfg, dev))

    from aisyn.fl.launch import simulate

    settings = federated_settings(
        preset, len(names), device, tensorboard=tensorboard, **(federated or {})
    )
    fed = simulate(
        base, {n: sft[n] for n in names}, runs / "federated", settings, echo=echo
    )
    hist = fed["history"]
    train_s = sum(h.get("client_train_s") or 0.0 for h in hist)
    overhead_s = fed["wall_s"] - train_s
    fed_model, _ = load_run_model(runs / "federated" / "server", dev)
    privacy = "".join(
        [", SecAgg+" * settings.secure_aggregation]
        + [f", DP {settings.dp} s={settings.dp_noise_multiplier:g}"]
        * (settings.dp != "off")
    )
    add_row(
        f"AIsyn federated ({settings.strategy}, {settings.method}{privacy})",
        fed_model,
        "prompt",
        epochs_or_rounds=f"{settings.rounds} rounds",
        steps=settings.total_local_steps * len(names),
        wall_s=fed["wall_s"],
        train_s=train_s,
        overhead_s=overhead_s,
        final_loss=hist[-1].get("train_loss") if hist else None,
        run=fed["run"],
    )
    plots["federated global"] = runs / "federated" / "server" / "loss.png"
    for n in names:
        client_run = Path(fed["clients"][n])
        model, _ = load_run_model(client_run, dev)
        rounds = [
            r for r in read_metrics(client_run / "metrics.jsonl") if "round_loss" in r
        ]
        add_row(
            f"client {n} local (after round {settings.rounds})",
            model,
            "prompt",
            epochs_or_rounds=f"{settings.rounds} rounds",
            steps=settings.total_local_steps,
            wall_s=fed["wall_s"],
            final_loss=rounds[-1]["round_loss"] if rounds else None,
            run=str(client_run),
        )
        plots[f"client {n}"] = client_run / "loss.png"

    report = {
        "domains": names,
        "preset": preset.to_dict(),
        "base": {"path": str(base), "build_s_this_run": base_build_s, **base_summary},
        "federated": {
            k: fed[k]
            for k in (
                "history",
                "final_global_valid_loss",
                "payload_bytes_per_client",
                "wall_s",
                "privacy",
            )
        },
        "rows": rows,
        "targets": check_targets(rows, names),
        "elapsed_s": time.perf_counter() - t_start,
    }
    write_report(out, report, plots)
    return report


def split_cut(cfg: ModelConfig) -> str:
    """A U-shape cut with one block on A at each end when the model has the
    blocks for it (B keeps the rest)."""
    return "u:1,1" if cfg.num_blocks >= 3 else "u:1,0"


def split_finetuned(
    name: str,
    base: Path,
    base_cfg: dict,
    data: Path,
    runs: Path,
    cfg: TrainConfig,
    dev,
) -> dict:
    """The data owner of ``name`` fine-tunes the base through a compute party
    (both in this process, over the in-memory link): the same steps as
    standalone fine-tuning, at split's cost. Returns ``add_row``'s arguments,
    the model being the two halves merged."""
    from aisyn.split.merge import merge
    from aisyn.split.session import COMPUTE_DIR, SplitOptions
    from aisyn.split.train import split_train

    mcfg = config_from_dict(base_cfg["model"])
    run = runs / f"{name}_split"
    cut = split_cut(mcfg)
    summary = split_train(
        mcfg,
        [data],
        run,
        cfg,
        # Pipelined where a step has micro-batches to overlap (split training
        # refuses --pipeline on a step of one).
        SplitOptions(cut=cut, mode="local", window=2 if cfg.grad_accum >= 2 else 0),
        sft=True,
        init_from=base,
        progress=False,
    )
    (compute_run,) = [
        p for p in (run / COMPUTE_DIR).iterdir() if (p / "checkpoints").is_dir()
    ]
    merge(run, compute_run, runs / f"{name}_split_merged")
    model, _ = load_run_model(runs / f"{name}_split_merged", dev)
    wire = summary["bytes_sent_per_step"] + summary["bytes_received_per_step"]
    return dict(
        regime=f"{name} split ft",
        model=model,
        fmt="prompt",
        epochs_or_rounds="-",
        steps=summary["steps"],
        wall_s=summary["elapsed_s"],
        final_loss=_final_loss(run / "metrics.jsonl"),
        bytes_on_wire=wire * summary["steps"],
        note=f"cut {cut}, in-process link",
        run=str(run),
    )


def _brief(row: dict, names: Sequence[str]) -> dict:
    return {
        **{f"acc_{n}": round(row[f"acc_{n}"]["accuracy"], 4) for n in names},
        **{f"loss_{n}": round(row[f"loss_{n}"], 4) for n in names},
    }


def check_targets(rows: list[dict], names: Sequence[str]) -> dict:
    """The issue's targets (a)-(d) on this table: values and pass/fail."""
    by = {r["regime"]: r for r in rows}
    fusion = by.get(f"{'+'.join(names)} ft")
    fed = next((r for r in rows if r["regime"].startswith("AIsyn federated")), None)
    out: dict = {}
    if not fusion or not fed:
        return out
    chance = {n: fusion[f"acc_{n}"]["chance"] for n in names}
    out["a_standalone_2x_chance"] = {
        n: {
            "accuracy": by[f"{n} ft"][f"acc_{n}"]["accuracy"],
            "needed": 2 * chance[n],
            "pass": by[f"{n} ft"][f"acc_{n}"]["accuracy"] >= 2 * chance[n],
        }
        for n in names
        if f"{n} ft" in by
    }
    # Split fine-tuning takes the same steps as standalone fine-tuning (to
    # float rounding), so it scores the same, item for item or nearly.
    out["e_split_equals_standalone"] = {
        n: {
            "split": by[f"{n} split ft"][f"acc_{n}"]["accuracy"],
            "standalone": by[f"{n} ft"][f"acc_{n}"]["accuracy"],
            "pass": abs(
                by[f"{n} split ft"][f"acc_{n}"]["accuracy"]
                - by[f"{n} ft"][f"acc_{n}"]["accuracy"]
            )
            <= 2 / by[f"{n} ft"][f"acc_{n}"]["items"],
        }
        for n in names
        if f"{n} split ft" in by and f"{n} ft" in by
    }
    out["b_fed_vs_fusion_accuracy"] = {}
    out["c_fed_vs_fusion_loss"] = {}
    out["d_fed_beats_other_standalone"] = {}
    for n in names:
        fa, fu = fed[f"acc_{n}"], fusion[f"acc_{n}"]
        out["b_fed_vs_fusion_accuracy"][n] = {
            "federated": fa["accuracy"],
            "fusion": fu["accuracy"],
            "fusion_ci95": fu["ci95"],
            "pass": abs(fa["accuracy"] - fu["accuracy"]) <= 0.01
            or fu["ci95"][0] <= fa["accuracy"] <= fu["ci95"][1],
        }
        out["c_fed_vs_fusion_loss"][n] = {
            "federated": fed[f"loss_{n}"],
            "fusion": fusion[f"loss_{n}"],
            "pass": abs(fed[f"loss_{n}"] - fusion[f"loss_{n}"]) <= 0.02,
        }
        others = [m for m in names if m != n and f"{m} ft" in by]
        out["d_fed_beats_other_standalone"][n] = {
            "federated": fa["accuracy"],
            **{
                f"standalone {m}": by[f"{m} ft"][f"acc_{n}"]["accuracy"] for m in others
            },
            "pass": all(
                fa["accuracy"] > by[f"{m} ft"][f"acc_{n}"]["accuracy"] for m in others
            ),
        }
    return out


#: each target of ``check_targets``, in the issue's order: what it asks, and
#: whether its numbers are losses (else accuracies)
TARGETS = {
    "a_standalone_2x_chance": ("(a) standalone >= 2x chance on its own domain", False),
    "b_fed_vs_fusion_accuracy": (
        "(b) federated within 1 point of fusion, or inside fusion's 95 % interval",
        False,
    ),
    "c_fed_vs_fusion_loss": (
        "(c) federated test loss within 0.02 nats of fusion's",
        True,
    ),
    "d_fed_beats_other_standalone": (
        "(d) federated beats each other domain's standalone model",
        False,
    ),
    "e_split_equals_standalone": ("(e) split fine-tuning scores as standalone", False),
}


def _fmt_target_value(key: str, value, loss: bool) -> str:
    if key.endswith("ci95"):
        lo, hi = value
        name = key.removesuffix("_ci95")
        return f"{name} 95 % interval [{100 * lo:.1f}, {100 * hi:.1f}]"
    number = f"{value:.4f}" if loss else f"{100 * value:.2f} %"
    return f"{key.replace('_', ' ')} {number}"


def targets_table(targets: dict) -> list[str]:
    """``check_targets``' verdicts as Markdown table lines: one row per target
    and domain, its numbers and whether it is met."""
    lines = ["| target | domain | numbers | result |", "|---|---|---|---|"]
    for key, per_domain in targets.items():
        title, loss = TARGETS.get(key, (key, False))
        for domain, verdict in per_domain.items():
            numbers = ", ".join(
                _fmt_target_value(k, v, loss) for k, v in verdict.items() if k != "pass"
            )
            result = "met" if verdict["pass"] else "**not met**"
            lines.append(f"| {title} | {domain} | {numbers} | {result} |")
    return lines


# --- the report --------------------------------------------------------------------


def _fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s / 60:.1f} min" if s >= 60 else f"{s:.0f} s"


def _fmt_acc(a: dict) -> str:
    lo, hi = a["ci95"]
    return f"{100 * a['accuracy']:.2f} % [{100 * lo:.1f}, {100 * hi:.1f}]"


def table_rows(report: dict) -> tuple[list[str], list[list[str]], list[dict]]:
    names = report["domains"]
    header = ["regime", "device", "epochs/rounds", "steps", "wall time", "final loss"]
    header += [f"Acc {n}" for n in names] + [f"test loss {n}" for n in names]
    md, flat = [], []
    for r in report["rows"]:
        wall = _fmt_time(r.get("wall_s"))
        if r.get("overhead_s") is not None:
            train_s, over_s = _fmt_time(r["train_s"]), _fmt_time(r["overhead_s"])
            wall += f" (train {train_s} + overhead {over_s})"
        if r.get("bytes_on_wire") is not None:
            wall += f" ({r['bytes_on_wire'] / 1e6:.1f} MB on the wire)"
        fl = r.get("final_loss")
        md.append(
            [
                r["regime"],
                r["device"],
                str(r["epochs_or_rounds"]),
                str(r["steps"]),
                wall,
                "-" if fl is None else f"{fl:.3f}",
                *[_fmt_acc(r[f"acc_{n}"]) for n in names],
                *[f"{r[f'loss_{n}']:.4f}" for n in names],
            ]
        )
        flat.append(
            {
                "regime": r["regime"],
                "device": r["device"],
                "epochs_or_rounds": r["epochs_or_rounds"],
                "steps": r["steps"],
                "wall_s": r.get("wall_s"),
                "train_s": r.get("train_s"),
                "overhead_s": r.get("overhead_s"),
                "bytes_on_wire": r.get("bytes_on_wire"),
                "final_loss": fl,
                **{f"acc_{n}": r[f"acc_{n}"]["accuracy"] for n in names},
                **{f"acc_{n}_ci_lo": r[f"acc_{n}"]["ci95"][0] for n in names},
                **{f"acc_{n}_ci_hi": r[f"acc_{n}"]["ci95"][1] for n in names},
                **{f"acc_{n}_items": r[f"acc_{n}"]["items"] for n in names},
                **{f"test_loss_{n}": r[f"loss_{n}"] for n in names},
                "format": r["format"],
            }
        )
    return header, md, flat


def write_report(out: Path, report: dict, plots: dict[str, Path]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    header, md_rows, flat = table_rows(report)
    plot_dir = out / "plots"
    plot_dir.mkdir(exist_ok=True)
    copied = []
    for name, src in plots.items():
        if Path(src).is_file():
            dst = plot_dir / f"{name.replace(' ', '_').replace('+', '_')}.png"
            shutil.copyfile(src, dst)
            copied.append((name, dst.relative_to(out)))
    plot_accuracy(report, plot_dir / ACCURACY_PNG)
    lines = [
        f"# Standalone vs data fusion vs federated ({', '.join(report['domains'])}; "
        f"preset `{report['preset']['name']}`)",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *["| " + " | ".join(r) + " |" for r in md_rows],
        "",
        "Accuracy: cloze items of each domain's test documents, 95 % bootstrap "
        "interval in brackets; the base is scored zero-shot (`lm` format), fine-tuned "
        "models in the `prompt` format they were trained on. Test loss: nats per "
        "token on each domain's raw test text. Steps: optimizer steps; the federated "
        "row counts all clients' local steps (each client ran "
        f"{report['preset']['finetune_steps'] // len(report['domains'])}).",
        "",
        "## Accuracy per domain",
        "",
        f"![accuracy per domain, by regime](plots/{ACCURACY_PNG})",
        "",
        "## Targets",
        "",
        *targets_table(report["targets"]),
        "",
        "## Loss curves",
        "",
        *[f"- {name}: ![{name}]({path})" for name, path in copied],
        "",
    ]
    (out / REPORT_MD).write_text("\n".join(lines), encoding="utf-8")
    with (out / REPORT_CSV).open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(flat[0]))
        w.writeheader()
        w.writerows(flat)
    write_json_atomic(out / REPORT_JSON, report)


def read_report(out: str | Path) -> dict:
    path = Path(out) / REPORT_JSON
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no comparison report")
    return json.loads(path.read_text())
