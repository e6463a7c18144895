"""``aisyn experiment compare``, ``aisyn prepare-sft`` and ``aisyn finetune``."""

from __future__ import annotations

from pathlib import Path

from aisyn import validate


def cmd_compare(args) -> None:
    from aisyn.experiments.compare import REPORT_MD, run_compare
    from aisyn.experiments.presets import get_preset

    preset = get_preset(args.preset).with_overrides(
        rounds=args.rounds,
        strategy=args.strategy,
        method=args.method,
        finetune_steps=args.steps,
        lr=args.lr,
    )
    report = run_compare(
        [d.strip() for d in args.domains.split(",") if d.strip()],
        preset,
        args.out,
        device=args.device,
        echo=args.echo,
        tensorboard=args.tensorboard,
    )
    print((Path(args.out) / REPORT_MD).read_text(encoding="utf-8"))
    print(f"took {report['elapsed_s'] / 60:.1f} min; wrote {args.out}")


def cmd_prepare_sft(args) -> None:
    from aisyn.data.corpora import load_corpora, portable_specs
    from aisyn.data.sft import prepare_sft
    from aisyn.data.tokenizer import PanguTokenizer

    tok = PanguTokenizer.load(args.tokenizer)
    m = prepare_sft(
        load_corpora(args.corpus),
        tok,
        args.seq_len,
        args.out,
        per_document=args.per_doc,
        test_per_document=args.test_per_doc,
        seed=args.seed,
        max_documents=args.max_docs,
        corpus_specs=portable_specs(args.corpus),
        overwrite=args.overwrite,
    )
    for split, s in m["splits"].items():
        print(f"{split:5s}: {s['items']:6d} cloze items")
    print(f"wrote {args.out}/manifest.json (tokenizer {tok.sha256[:12]})")


def cmd_finetune(args) -> None:
    from aisyn.train.finetune import finetune
    from aisyn.train.flags import train_config_from_args
    from aisyn.train.lora import Method

    summary = finetune(
        args.base,
        args.data,
        args.out,
        train_config_from_args(args),
        Method(args.method, rank=args.lora_rank, alpha=args.lora_alpha),
        progress=not args.quiet,
        tensorboard=args.tensorboard,
    )
    print(
        f"final loss {summary['final_loss']:.4f} after {summary['steps']} steps "
        f"({summary['epochs']:.2f} epochs, {summary['elapsed_s']:.1f} s, "
        f"{summary['trainable_parameters']} trainable parameters)"
    )
    print(f"run folder: {summary['run']}  loss plot: {summary['plot']}")


def register(sub) -> None:
    from aisyn.train.flags import add_train_args

    ex = sub.add_parser(
        "experiment",
        help="the standalone / fusion / federated comparison",
        description="Experiments of the reference's collaborative-training study.",
    )
    esub = ex.add_subparsers(dest="experiment_command", required=True, metavar="NAME")
    c = esub.add_parser(
        "compare",
        help="standalone vs data fusion vs federated fine-tuning",
        description="Pretrain (once, cached) a base model on all domains' raw text, "
        "fine-tune it on supervised cloze items standalone per domain, pooled "
        "(data fusion) and federated (one client per domain, Flower on loopback) "
        "with an equal budget of optimizer steps, and write the reference's table "
        "(Markdown, CSV), loss curves and report.json to --out.",
    )
    c.add_argument("--domains", default="news,reviews", help="comma-separated corpora")
    c.add_argument("--preset", choices=["ci", "full"], default="ci")
    c.add_argument("--out", required=True, help="report folder")
    c.add_argument("--device", type=validate.device, default="auto")
    c.add_argument(
        "--rounds",
        type=validate.positive_int,
        default=None,
        help="override federated rounds",
    )
    c.add_argument(
        "--strategy",
        choices=["fedavg", "fedprox", "fedadam", "fedavgm"],
        default=None,
        help="override the federated strategy",
    )
    c.add_argument("--method", choices=["full", "lora"], default=None)
    c.add_argument(
        "--steps",
        type=validate.positive_int,
        default=None,
        help="override the step budget",
    )
    c.add_argument(
        "--lr",
        type=validate.positive_float,
        default=None,
        help="override the fine-tuning lr",
    )
    c.add_argument("--echo", action="store_true", help="stream the Flower server log")
    c.add_argument(
        "--tensorboard",
        action="store_true",
        help="every run of the comparison also writes TensorBoard event files",
    )
    c.set_defaults(func=cmd_compare)

    p = sub.add_parser(
        "prepare-sft",
        help="supervised cloze data (prompt + answer) for fine-tuning",
        description="Build cloze items from the train/valid documents of the given "
        "corpora and store them tokenised (prompt with the blank marked, answer, "
        "loss mask on the answer) as safetensors, plus the test items as JSON lines.",
    )
    p.add_argument("--corpus", nargs="+", required=True, help="news, reviews or files")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--tokenizer", default=None, help="tokenizer name or .model file")
    p.add_argument("--seq-len", type=validate.positive_int, default=128)
    p.add_argument(
        "--per-doc",
        type=validate.positive_int,
        default=5,
        help="blanks per train document",
    )
    p.add_argument(
        "--test-per-doc",
        type=validate.positive_int,
        default=5,
        help="blanks per test document",
    )
    p.add_argument("--max-docs", type=validate.positive_int, default=None)
    p.add_argument("--seed", type=validate.nonneg_int, default=0)
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=cmd_prepare_sft)

    f = sub.add_parser(
        "finetune",
        help="supervised cloze fine-tuning (standalone or pooled data)",
        description="Fine-tune a base run on one or more SFT folders (pooled: data "
        "fusion). The run folder is marked kind=finetune so `aisyn eval` scores it "
        "in the prompt format.",
    )
    f.add_argument("--base", required=True, help="base model run folder")
    f.add_argument("--data", action="append", required=True, help="SFT folder (repeat)")
    f.add_argument("--out", required=True, help="run folder")
    f.add_argument("--method", choices=["full", "lora"], default="full")
    f.add_argument("--lora-rank", type=validate.positive_int, default=8)
    f.add_argument("--lora-alpha", type=validate.positive_float, default=16.0)
    f.add_argument("--quiet", action="store_true")
    # fine-tuning always starts fresh: a --resume here would be ignored
    add_train_args(f, steps=200, resumable=False)
    f.set_defaults(func=cmd_finetune)
