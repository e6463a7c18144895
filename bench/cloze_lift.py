"""How much supervised cloze fine-tuning lifts a preset's base, against steps.

Issue 40 asks for a base "where fine-tuning matters": supervised cloze
fine-tuning must lift each domain's accuracy by >= 15 points over the untuned
base. This fine-tunes the preset's cached base (``aisyn experiment compare``'s,
pretrained on the preset's public corpora) on one domain at a time, keeps a
checkpoint every ``--every`` steps, and scores each checkpoint on every
domain's test items, as the comparison scores its rows:

    python bench/cloze_lift.py --preset reference --out /tmp/lift

(the preset's recipe: on ``reference``, 1 600 steps at lr 1e-3 with the loss
on the whole item; ``--steps``, ``--lr``, ``--supervise`` try others).

``--supervise answer|item``: the loss on the answer alone, or on the whole
item (passage and answer).
``--tune reviews``: fine-tune on that domain only (every domain is scored).
``--max-train-items N``: fine-tune on the first N training items of the
domain's (seeded IID) deal instead -- a data owner with little data, where
pooling could pay.
``--pooled``: one model on all the tuned domains' items together (data
fusion, as the comparison's fusion row), instead of one model a domain.
``--batch-size 32 --steps 800 --pooled``: fusion at a two-client
federation's parallelism -- the same examples in half the sequential steps,
as two clients of batch 16 take them side by side -- the control that tells
what a federation loses to parallel steps from what it loses to non-IID data.

Prints one line per checkpoint and domain, then
``lift DOMAIN: base B % (best format) -> A % after S steps (+L pts)``
for the best checkpoint, and writes OUT/lift.json. Each run resumes from its
folder. Seconds are wall clock on whatever else the machine is running.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from aisyn.data.sft import SUPERVISE, SFTData
from aisyn.experiments.compare import prepare_inputs
from aisyn.fl.partition import partition_iid
from aisyn.testbed.presets import get_preset
from aisyn.train import checkpoint as ckpt
from aisyn.train.finetune import finetune
from aisyn.train.lora import Method
from aisyn.train.models import load_model_checkpoint, load_run_model


def capped(sft: Path, out: Path, items: int) -> Path:
    """About ``items`` training items of ``sft`` (one part of a seeded IID
    deal; valid and test items as the domain's)."""
    n = len(SFTData.open(sft, "train", verify=False))
    if items >= n:
        return sft
    folder = out / f"{sft.name}-cap{items}"
    if not (folder / "part0" / "manifest.json").is_file():
        partition_iid([sft], folder, n // items, seed=0)
    return folder / "part0"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="reference")
    p.add_argument("--domains", default="news,reviews", help="scored")
    p.add_argument("--tune", default=None, help="fine-tuned (all --domains)")
    p.add_argument("--steps", type=int, default=None, help="(the preset's)")
    p.add_argument("--every", type=int, default=None, help="(steps / 4)")
    p.add_argument("--lr", type=float, default=None, help="(the preset's)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="(the preset's) e.g. fusion at a federation's parallelism: K clients "
        "of batch b step together as one batch of K*b, in 1/K of the steps",
    )
    p.add_argument("--max-train-items", type=int, default=None)
    p.add_argument("--pooled", action="store_true", help="one model, all --tune")
    p.add_argument(
        "--supervise", choices=SUPERVISE, default=None,
        help="what the loss covers (the preset's)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if args.batch_size is not None and args.batch_size < 1:
        raise SystemExit(f"--batch-size must be >= 1, got {args.batch_size}")
    preset = get_preset(args.preset).with_overrides(supervise=args.supervise)
    domains = args.domains.split(",")
    stems = [Path(d).stem for d in domains]
    tuned = args.tune.split(",") if args.tune else stems
    if unknown := set(tuned) - set(stems):
        raise SystemExit(f"--tune names no domain of --domains: {sorted(unknown)}")
    inputs = prepare_inputs(domains, preset, args.device)
    names = inputs.names
    model, _ = load_run_model(inputs.base, inputs.device)
    # The base has never seen a prompt: it is scored in both formats, and its
    # lift is counted from the better one.
    base_acc = {
        fmt: {
            n: 100 * a["accuracy"]
            for n, a in inputs.evaluate.accuracy(model, fmt).items()
        }
        for fmt in ("lm", "prompt")
    }
    print(f"base: {json.dumps(base_acc)}", flush=True)
    report = {"preset": preset.name, "base": base_acc, "runs": {}}
    data = {n: inputs.sft[n] for n in tuned}
    if args.max_train_items:
        data = {n: capped(d, args.out, args.max_train_items) for n, d in data.items()}
    # a run's name: its domain, or the pooled domains joined by "+"
    runs = {"+".join(tuned): list(data.values())} if args.pooled else {
        n: [d] for n, d in data.items()
    }  # fmt: skip
    for name, folders in runs.items():
        cfg = preset.finetune_config(args.steps)
        cfg.lr = args.lr or cfg.lr
        cfg.batch_size = args.batch_size or cfg.batch_size
        cfg.seed, cfg.device = args.seed, args.device
        cfg.ckpt_every = args.every or max(1, cfg.steps // 4)
        cfg.keep_checkpoints = cfg.steps // cfg.ckpt_every + 1
        tag = f"-cap{args.max_train_items}" if args.max_train_items else ""
        tag += f"-b{args.batch_size}" if args.batch_size else ""
        run = args.out / f"{name}-{cfg.steps}{tag}-{preset.supervise}"
        t0 = time.perf_counter()
        finetune(
            inputs.base, folders, run, cfg, Method(), progress=False,
            resume=(run / "config.json").is_file(),
        )  # fmt: skip
        train_s = time.perf_counter() - t0
        points = []
        for step in ckpt.complete_steps(run / "checkpoints"):
            load_model_checkpoint(model, ckpt.step_folder(run / "checkpoints", step))
            acc = {
                n: 100 * a["accuracy"]
                for n, a in inputs.evaluate.accuracy(model, "prompt").items()
            }
            points.append({"step": step, **acc})
            print(
                f"{name} ft step {step}: "
                + ", ".join(f"{n} {acc[n]:.2f} %" for n in names),
                flush=True,
            )
        report["runs"][name] = {
            "items": sum(len(SFTData.open(d, "train", verify=False)) for d in folders),
            "train_s": train_s,
            "points": points,
        }
    for name in tuned:
        run = next(r for r in runs if name in r.split("+"))
        floor = max(base_acc["lm"][name], base_acc["prompt"][name])
        best = max(report["runs"][run]["points"], key=lambda pt: pt[name])
        by = f" ({run} ft)" if run != name else ""
        print(
            f"lift {name}{by}: base {floor:.1f} % (best format) -> {best[name]:.1f} "
            f"% after {best['step']} steps ({best[name] - floor:+.1f} pts)"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lift.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
