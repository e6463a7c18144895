"""Split fine-tuning against standalone fine-tuning on the comparison's data.

The same base, SFT data, settings and evaluator as ``aisyn experiment
compare --preset P`` (its cached base and data are reused): the data owner of
``--domain`` fine-tunes standalone (``aisyn finetune``) and through a compute
party in this process (``aisyn split train --sft``, cut u:1,1), and both are
scored on every domain's cloze test items. Prints accuracy and test loss of
each, the split run's wall time and bytes on the wire.

    python bench/split_finetune.py --preset full --domain news
    python bench/split_finetune.py --preset full --domain news \\
        --standalone RUN    # reuse a standalone run of the same settings
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from aisyn.experiments.compare import prepare_inputs, split_finetuned
from aisyn.testbed.presets import PRESETS
from aisyn.train.finetune import finetune
from aisyn.train.models import load_run_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="ci")
    ap.add_argument("--domains", default="news,reviews")
    ap.add_argument("--domain", default="news", help="the data owner's domain")
    ap.add_argument("--standalone", help="a standalone run of the same settings")
    ap.add_argument("--out", help="where the runs go (default: a temporary folder)")
    args = ap.parse_args()
    preset = PRESETS[args.preset]
    inputs = prepare_inputs(args.domains.split(","), preset, "cpu")
    cfg = preset.finetune_config()
    cfg.device = "cpu"
    with tempfile.TemporaryDirectory(prefix="aisyn-splitft-") as tmp:
        runs = Path(args.out or tmp)
        runs.mkdir(parents=True, exist_ok=True)
        base_cfg = json.loads((inputs.base / "config.json").read_text())
        data = inputs.sft[args.domain]
        row = split_finetuned(
            args.domain, inputs.base, base_cfg, data, runs, cfg, "cpu"
        )
        scores = {"split": inputs.evaluate(row.pop("model"), "prompt")}
        alone = args.standalone
        if alone is None:
            alone = runs / f"{args.domain}_standalone"
            finetune(inputs.base, [data], alone, cfg, progress=False)
        scores["standalone"] = inputs.evaluate(load_run_model(alone)[0], "prompt")
    names = args.domains.split(",")
    print("| regime | " + " | ".join(f"Acc {n} | test loss {n}" for n in names) + " |")
    print("|---|" + "---|---|" * len(names))
    for regime, s in scores.items():
        cells = [
            f"{100 * s[f'acc_{n}']['accuracy']:.2f} % | {s[f'loss_{n}']:.4f}"
            for n in names
        ]
        print(f"| {args.domain} {regime} ft | " + " | ".join(cells) + " |")
    print(
        f"split: {row['steps']} steps in {row['wall_s']:.0f} s, "
        f"{row['bytes_on_wire'] / 1e9:.2f} GB on the in-process link ({row['note']})"
    )


if __name__ == "__main__":
    main()
