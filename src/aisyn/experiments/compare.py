"""``aisyn experiment compare``: standalone vs fusion vs federated, as the reference.

1. Token shards of each domain's raw text and a common *base model* pretrained
   on both, or on the preset's public corpora only (our stand-in for
   pretrained PanGu-α), built once and cached (``testbed.inputs``).
2. Supervised cloze items of each domain's train documents (``prepare_sft``;
   cached), loss on the answer tokens (the preset's ``supervise``: or the
   whole item).
3. Fine-tune the base, with the same budget of optimizer steps, as
   standalone(d) for each domain, fusion(all domains pooled) and federated
   (one client per domain, through Flower's runtime on loopback), split
   (each domain's owner through an in-process compute party) and SplitFed
   (one party per domain, one shared backbone at the compute party, the
   parties' own segments averaged by the federated regime's strategy;
   ``aisyn.splitfed``).
4. Score the untuned base (``lm`` format) and every fine-tuned model (``prompt``
   format, as trained) on each domain's test items, and its LM loss on each
   domain's raw test text (``evaluator``); judge the targets (``targets``);
   write the reference's table, the targets, a chart of every regime's
   accuracy per domain and the per-node loss curves into one folder
   (``report``).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from aisyn.data.corpora import BUILTIN_CORPORA
from aisyn.data.tokenizer import PanguTokenizer
from aisyn.experiments.evaluator import Evaluator
from aisyn.experiments.report import REPORT_JSON, write_report
from aisyn.experiments.targets import check_targets
from aisyn.fl.settings import FLSettings
from aisyn.model.causal_lm import CausalLM
from aisyn.model.families import config_from_dict
from aisyn.testbed.inputs import cached_base, cached_sft, cached_shards
from aisyn.testbed.presets import Preset
from aisyn.train.config import TrainConfig
from aisyn.train.device import resolve_device
from aisyn.train.finetune import finetune
from aisyn.train.lora import Method
from aisyn.train.models import load_run_model
from aisyn.train.run import read_metrics, write_json_atomic
from aisyn.validate import holds_run, read_json

log = logging.getLogger("aisyn.experiments")


def _final_loss(metrics_path: Path, key: str = "loss", last: int = 10) -> float | None:
    """Mean of the last ``last`` logged training losses (one step is noisy)."""
    vals = [r[key] for r in read_metrics(metrics_path) if key in r]
    return sum(vals[-last:]) / len(vals[-last:]) if vals else None


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
    # the base learns the domains' own text, or only the preset's public text
    public = [cached_shards(c, tok, preset) for c in preset.public]
    t0 = time.perf_counter()
    base = cached_base(preset, public or list(shards.values()), tok, device)
    base_build_s = time.perf_counter() - t0
    sft = {n: cached_sft(d, tok, preset) for n, d in zip(names, domains, strict=True)}
    evaluate = Evaluator(
        names, sft, shards, tok, preset.seq_len, preset.max_test_items, dev
    )
    return Inputs(names, base, base_build_s, shards, sft, evaluate, dev)


#: the federated settings a preset sets, under the same names
_PRESET_FL_SETTINGS = (
    "rounds",
    "batch_size",
    "lr",
    "min_lr",
    "warmup",
    "weight_decay",
    "seed",
    "schedule",
    "method",
    "strategy",
    "proximal_mu",
    "server_lr",
    "server_momentum",
    "eta",
    "eval_items",
)


def federated_settings(
    preset: Preset, clients: int, device: str, **overrides
) -> FLSettings:
    """The preset's federated settings (equal step budget), then ``overrides``."""
    d = {name: getattr(preset, name) for name in _PRESET_FL_SETTINGS}
    d.update(
        local_steps=preset.local_steps(clients), min_clients=clients, device=device
    )
    d.update(overrides)
    if "rounds" in overrides and "local_steps" not in overrides:
        d["local_steps"] = preset.finetune_steps // clients // d["rounds"]
    return FLSettings.from_dict(d)


#: the comparison's regimes besides the untuned base, in the order they run
REGIMES = ("standalone", "fusion", "split", "federated", "splitfed")


def check_regimes(regimes: Sequence[str]) -> list[str]:
    """``regimes`` in ``REGIMES``' order; one line for an unknown or no regime."""
    unknown = sorted(set(regimes) - set(REGIMES))
    if unknown or not regimes:
        raise ValueError(
            f"--regimes {','.join(regimes)}: expected some of {','.join(REGIMES)}"
        )
    return [r for r in REGIMES if r in regimes]


def run_compare(
    domains: Sequence[str],
    preset: Preset,
    out: str | Path,
    *,
    device: str = "auto",
    echo: bool = False,
    tensorboard: bool = False,
    federated: dict | None = None,
    regimes: Sequence[str] = REGIMES,
    resume: bool = False,
) -> dict:
    """The ``regimes`` of the comparison in ``out``; ``tensorboard``: each
    fine-tuning run, the federated server and its clients also write
    TensorBoard event files; ``federated``: federated settings by name (e.g.
    secure-aggregation, dp), over the preset's (SplitFed takes them too,
    but for secure aggregation, which one process cannot use).

    ``resume``: continue the comparison in ``out`` (one killed, say): each
    regime's run goes on from its own checkpoint (a finished one is not
    redone) and every row is scored again; refused in one line unless
    ``out`` holds a comparison of the same domains, preset, regimes and
    federated settings."""
    regimes = check_regimes(regimes)
    t_start = time.perf_counter()
    out = Path(out)
    recipe = {
        "domains": list(domains),
        "preset": preset.to_dict(),
        "regimes": regimes,
        "federated": federated or {},
    }
    recipe = json.loads(json.dumps(recipe))  # as it reads back (lists, not tuples)
    if resume:
        check_same_comparison(out, recipe)
    elif (out / REPORT_JSON).exists() or (out / "runs").exists():
        raise FileExistsError(
            f"{out}: holds an earlier comparison; choose another --out, or --resume it"
        )
    inputs = prepare_inputs(domains, preset, device)
    names, base, sft = inputs.names, inputs.base, inputs.sft
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=resume)
    write_json_atomic(out / RECIPE, recipe)
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
            base, data, run, cfg, method, progress=False, tensorboard=tensorboard,
            resume=resume and holds_run(run),
        )  # fmt: skip
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

    if "standalone" in regimes:
        for n in names:
            finetuned(n, [sft[n]])
    if "fusion" in regimes:
        finetuned("+".join(names), [sft[n] for n in names])
    if "split" in regimes and method.name == "full":  # it trains every weight
        for n in names:
            add_row(
                **split_finetuned(n, base, base_cfg, sft[n], runs, cfg, dev, resume)
            )

    settings = federated_settings(
        preset, len(names), device, tensorboard=tensorboard, **(federated or {})
    )
    privacy = "".join(
        [", SecAgg+" * settings.secure_aggregation]
        + [f", DP {settings.dp} s={settings.dp_noise_multiplier:g}"]
        * (settings.dp != "off")
    )
    fed = None
    if "federated" in regimes:
        fed = _federated(inputs, runs, settings, privacy, echo, add_row, plots, resume)
    if "splitfed" in regimes:
        add_row(**splitfed_row(inputs, runs, settings, dev, resume))
        plots["splitfed"] = runs / "splitfed" / "loss.png"

    report = {
        "domains": names,
        "preset": preset.to_dict(),
        "regimes": regimes,
        "base": {"path": str(base), "build_s_this_run": base_build_s, **base_summary},
        "rows": rows,
        "targets": check_targets(rows, names),
        "elapsed_s": time.perf_counter() - t_start,
    }
    if fed is not None:
        report["federated"] = {
            k: fed[k]
            for k in (
                "history",
                "final_global_valid_loss",
                "payload_bytes_per_client",
                "wall_s",
                "privacy",
            )
        }
    write_report(out, report, plots)
    return report


def _federated(
    inputs: Inputs, runs: Path, settings, privacy, echo, add_row, plots, resume=False
):
    """The federated regime: its global model's row and each client's."""
    from aisyn.fl.launch import simulate

    names, base, sft, dev = inputs.names, inputs.base, inputs.sft, inputs.device
    fed = simulate(
        base, {n: sft[n] for n in names}, runs / "federated", settings, echo=echo,
        resume=resume and holds_run(runs / "federated" / "server"),
    )  # fmt: skip
    hist = fed["history"]
    train_s = sum(h.get("client_train_s") or 0.0 for h in hist)
    overhead_s = fed["wall_s"] - train_s
    fed_model, _ = load_run_model(runs / "federated" / "server", dev)
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
        # the global model to each client and its update back, every round
        bytes_on_wire=2 * fed["payload_bytes_per_client"] * len(names) * len(hist),
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
    return fed


def splitfed_row(
    inputs: Inputs, runs: Path, settings: FLSettings, dev, resume: bool = False
) -> dict:
    """SplitFed (``aisyn.splitfed``): one party per domain, the same rounds,
    local steps and strategy as the federated regime, one shared backbone at
    an in-process compute party. Returns ``add_row``'s arguments, the model
    being the global segments and the backbone merged."""
    from aisyn.splitfed.run import run_splitfed

    settings = replace(
        settings, secure_aggregation=False, max_message_mb=0.0, tensorboard=False
    )
    names = inputs.names
    sf = run_splitfed(
        inputs.base, {n: inputs.sft[n] for n in names}, runs / "splitfed", settings,
        resume=resume and holds_run(runs / "splitfed"),
    )  # fmt: skip
    model, _ = load_run_model(sf["merged"], dev)
    dp = f", DP {settings.dp}" * (settings.dp != "off")
    history = sf["history"]
    cut = json.loads((runs / "splitfed" / "config.json").read_text())["split"]["cut"]
    return dict(
        regime=f"AIsyn splitfed ({settings.strategy}, {settings.method}{dp})",
        model=model,
        fmt="prompt",
        epochs_or_rounds=f"{settings.rounds} rounds",
        steps=sf["backbone_steps"],
        wall_s=sf["elapsed_s"],
        train_s=sf["train_s"],
        overhead_s=sf["elapsed_s"] - sf["train_s"],
        final_loss=history[-1]["train_loss"] if history else None,
        bytes_on_wire=sf["link_bytes"] + sf["segment_bytes"],
        note=f"cut {cut}, one backbone at B, segments averaged every "
        f"{settings.local_steps} steps (in-process links); "
        f"{sf['link_bytes'] / 1e6:.1f} MB cut tensors + "
        f"{sf['segment_bytes'] / 1e6:.1f} MB segments",
        run=sf["run"],
    )


def split_finetuned(
    name: str,
    base: Path,
    base_cfg: dict,
    data: Path,
    runs: Path,
    cfg: TrainConfig,
    dev,
    resume: bool = False,
) -> dict:
    """The data owner of ``name`` fine-tunes the base through a compute party
    (both in this process, over the in-memory link): the same steps as
    standalone fine-tuning, at split's cost. Returns ``add_row``'s arguments,
    the model being the two halves merged."""
    from aisyn.split.client.merge import merge
    from aisyn.split.client.train import split_train
    from aisyn.split.session import COMPUTE_DIR, SplitOptions
    from aisyn.splitfed.run import default_cut

    mcfg = config_from_dict(base_cfg["model"])
    run = runs / f"{name}_split"
    cut = default_cut(mcfg.num_blocks)
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
        resume=resume and holds_run(run),
    )
    (compute_run,) = [
        p for p in (run / COMPUTE_DIR).iterdir() if (p / "checkpoints").is_dir()
    ]
    merged = runs / f"{name}_split_merged"
    shutil.rmtree(merged, ignore_errors=True)  # derived: merged again
    merge(run, compute_run, merged)
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


#: what a comparison was run with (``--resume`` must give the same)
RECIPE = "compare.json"


def check_same_comparison(out: Path, recipe: dict) -> None:
    """Refuse, in one line and before anything is written, to resume ``out``
    unless it holds a comparison of this ``recipe``."""
    path = out / RECIPE
    if not path.is_file():
        raise ValueError(f"--resume: {out} holds no comparison (no {RECIPE})")
    try:
        old = read_json(path)
    except ValueError as e:
        raise ValueError(f"--resume: {path}: {e}") from None
    if not isinstance(old, dict):
        raise ValueError(f"--resume: {path}: not a comparison's recipe")
    differ = [
        k
        for k in recipe
        if k != "preset"
        and old.get(k) != recipe[k]
        or k == "preset"
        and _preset_differs(old.get(k), recipe[k])
    ]
    if differ:
        raise ValueError(
            f"--resume: {out} holds a comparison of other {', '.join(differ)}; "
            "resume it with the same --domains, --preset (and its overrides), "
            "--regimes and --fl-set, or choose another --out"
        )


#: the table's axes: a resumed table may add to them (each seed, partition
#: and method is a run of its own, which the others do not see)
_EXTENSIBLE = ("methods", "partitions", "seeds")


def _preset_differs(old, new: dict) -> bool:
    """Whether a saved preset (``old``, as read back) differs from ``new`` in
    anything its runs depend on. A setting the saved one lacks counts as the
    same at its default: a later version added it, and its default is what
    the earlier one did (``server_lr`` 1, FedAvgM's own)."""
    if not isinstance(old, dict):
        return True
    new = json.loads(json.dumps(new))  # as it reads back (lists, not tuples)
    defaults = json.loads(json.dumps(Preset(name="").to_dict()))
    for k, v in new.items():
        was = old.get(k, defaults.get(k))
        if k in _EXTENSIBLE and isinstance(was, list) and isinstance(v, list):
            if not set(map(json.dumps, was)) <= set(map(json.dumps, v)):
                return True
        elif was != v:
            return True
    return bool(set(old) - set(new))


def _brief(row: dict, names: Sequence[str]) -> dict:
    return {
        **{f"acc_{n}": round(row[f"acc_{n}"]["accuracy"], 4) for n in names},
        **{f"loss_{n}": round(row[f"loss_{n}"], 4) for n in names},
    }
