"""``aisyn experiment compare``, ``aisyn prepare-sft`` and ``aisyn finetune``."""

from __future__ import annotations

from pathlib import Path

from aisyn import validate
from aisyn.data.sft import SUPERVISE
from aisyn.fl.settings import STRATEGIES
from aisyn.testbed.presets import PRESETS
from aisyn.train.lora import METHODS, Method
from aisyn.validate import positive_float, positive_int

REGIMES_DEFAULT = "standalone,fusion,split,federated,splitfed"


def cmd_compare(args) -> None:
    """Pretrain (once, cached) a base model on all domains' raw text, fine-tune it
    on supervised cloze items standalone per domain, pooled (data fusion) and
    federated (one client per domain, Flower on loopback), split (through an
    in-process compute party) and SplitFed (one party per domain sharing one
    backbone) with an equal budget of optimizer steps, and write the
    reference's table (Markdown, CSV), loss curves and report.json to --out."""

    from aisyn.experiments.compare import check_regimes, run_compare
    from aisyn.experiments.report import REPORT_MD
    from aisyn.testbed.presets import get_preset

    preset = get_preset(args.preset).with_overrides(
        rounds=args.rounds,
        strategy=args.strategy,
        method=args.method,
        finetune_steps=args.steps,
        lr=args.lr,
    )
    domains = [d.strip() for d in args.domains.split(",") if d.strip()]
    if preset.methods:  # the reference's table: every method, partition, seed
        from aisyn.experiments.table import TABLE_MD, run_table

        given = [
            flag
            for flag, value, default in (
                ("--strategy", args.strategy, None),
                ("--fl-set", args.fl_set, None),
                ("--regimes", args.regimes, REGIMES_DEFAULT),
                ("--echo", args.echo, False),
                ("--tensorboard", args.tensorboard, False),
            )
            if value not in (default, [])
        ]
        if given:
            raise ValueError(
                f"--preset {args.preset} runs the whole table (every regime, "
                f"method, partition and seed): drop {', '.join(given)}"
            )
        table = run_table(
            domains, preset, args.out, device=args.device, resume=args.resume
        )
        print((Path(args.out) / TABLE_MD).read_text(encoding="utf-8"))
        print(f"took {table['elapsed_s'] / 60:.1f} min; wrote {args.out}")
        print(table["summary"])
        return
    report = run_compare(
        domains,
        preset,
        args.out,
        device=args.device,
        echo=args.echo,
        tensorboard=args.tensorboard,
        federated=parse_fl_settings(args.fl_set or []),
        regimes=check_regimes(
            [r.strip() for r in args.regimes.split(",") if r.strip()]
        ),
        resume=args.resume,
    )
    print((Path(args.out) / REPORT_MD).read_text(encoding="utf-8"))
    print(f"took {report['elapsed_s'] / 60:.1f} min; wrote {args.out}")


def parse_fl_settings(specs: list[str]) -> dict:
    """``--fl-set KEY=VALUE`` pairs as federated settings (VALUE in TOML, a bare
    word a string: ``secure-aggregation=true``, ``dp=client``), checked now."""
    import tomllib

    from aisyn.fl.settings import FLSettings

    out: dict = {}
    for spec in specs:
        key, sep, value = spec.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--fl-set {spec!r}: expected KEY=VALUE")
        try:
            parsed = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            parsed = value
        out[key.strip()] = parsed
    FLSettings.from_dict({"min_clients": 2, **out}, "--fl-set")
    return out


def cmd_prepare_sft(args) -> None:
    """Build cloze items from the train/valid documents of the given corpora and
    store them tokenised (prompt with the blank marked, answer, loss mask on the
    answer) as safetensors, plus the test items as JSON lines."""

    from aisyn.data.corpora import load_corpora, portable_specs
    from aisyn.data.sft import prepare_sft
    from aisyn.data.tokenizer import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    m = prepare_sft(
        load_corpora(args.corpus),
        tok,
        args.seq_len,
        args.out,
        per_document=args.per_doc,
        test_per_document=args.test_per_doc,
        seed=args.seed,
        max_documents=args.max_docs,
        supervise=args.supervise,
        corpus_specs=portable_specs(args.corpus),
        overwrite=args.overwrite,
    )
    for split, s in m["splits"].items():
        print(f"{split:5s}: {s['items']:6d} cloze items")
    print(f"wrote {args.out}/manifest.json (tokenizer {tok.sha256[:12]})")


def cmd_finetune(args) -> None:
    """Fine-tune a base run on one or more SFT folders (pooled: data fusion). The
    run folder is marked kind=finetune so `aisyn eval` scores it in the prompt
    format."""

    from aisyn.train.finetune import finetune
    from aisyn.train.flags import job_from_args, print_summary, train_config_from_args

    summary = finetune(
        args.base,
        args.data,
        args.out,
        train_config_from_args(args),
        Method(args.method, rank=args.lora_rank, alpha=args.lora_alpha),
        **job_from_args(args),
    )
    print_summary(
        summary,
        f"({summary['epochs']:.2f} epochs, {summary['elapsed_s']:.1f} s, "
        f"{summary['trainable_parameters']} trainable parameters)",
    )


def register(sub) -> None:
    from aisyn.flagtable import (
        DEVICE,
        QUIET,
        REQUIRED,
        add_command,
        add_flags,
        add_group,
    )
    from aisyn.train.flags import (
        DATA_PARALLEL,
        LORA_FLAGS,
        SYNC_FLAGS,
        add_train_args,
    )
    from aisyn.train.lora import Method

    esub = add_group(
        sub,
        "experiment",
        "the standalone / fusion / federated comparison",
        description="Experiments of the reference's collaborative-training study.",
        metavar="NAME",
    )
    # A command's --help description is its cmd_* function's docstring.
    c = add_command(
        esub,
        "compare",
        cmd_compare,
        "standalone vs data fusion vs federated fine-tuning",
    )
    add_flags(
        c,
        ("--domains", None, "news,reviews", "comma-separated corpora"),
        (
            "--preset",
            list(PRESETS),
            "ci",
            "ci: minutes; full: the README table; reference: the reference's "
            "table over federated methods, partitions and seeds (reference-ci: "
            "its minutes-long form)",
        ),
        ("--out", None, REQUIRED, "report folder"),
        DEVICE,
        ("--rounds", positive_int, None, "override federated rounds"),
        ("--strategy", list(STRATEGIES), None, "override the federated strategy"),
        ("--method", list(METHODS), None, "override: full weights or LoRA"),
        ("--steps", positive_int, None, "override the step budget"),
        (
            "--regimes",
            None,
            REGIMES_DEFAULT,
            "comma-separated regimes to run (the untuned base always)",
        ),
        ("--lr", positive_float, None, "override the fine-tuning lr"),
        ("--echo", "store_true", None, "stream the Flower server log"),
        (
            "--fl-set",
            "append",
            None,
            "a federated setting KEY=VALUE for the federated regime (repeat; "
            "e.g. secure-aggregation=true, dp=client, dp-noise-multiplier=0.5)",
        ),
        (
            "--tensorboard",
            "store_true",
            None,
            "every run of the comparison also writes TensorBoard event files",
        ),
        (
            "--resume",
            "store_true",
            None,
            "continue the comparison in --out (one killed, say): each regime's "
            "run from its own checkpoint, a finished one not redone; the same "
            "flags as it was started with",
        ),
    )

    p = add_command(
        sub,
        "prepare-sft",
        cmd_prepare_sft,
        "supervised cloze data (prompt + answer) for fine-tuning",
    )
    p.add_argument("--corpus", nargs="+", required=True, help="news, reviews or files")
    add_flags(
        p,
        ("--out", None, REQUIRED, "output folder"),
        (
            "--tokenizer",
            None,
            None,
            "shipped tokenizer name (default zh8k), .model file, hf:DIR or "
            "tokenizer.json (a Hugging Face tokenizer)",
        ),
        ("--seq-len", positive_int, 128, "tokens per item at most"),
        ("--per-doc", positive_int, 5, "blanks per train document"),
        ("--test-per-doc", positive_int, 5, "blanks per test document"),
        ("--max-docs", positive_int, None, "use only the first N documents"),
        ("--seed", validate.seed, 0, "seed of the blanks and candidates"),
        (
            "--supervise",
            list(SUPERVISE),
            "answer",
            "what the loss covers: the answer, or the whole item (passage too)",
        ),
        ("--overwrite", "store_true", None, "replace an existing folder"),
    )

    f = add_command(
        sub,
        "finetune",
        cmd_finetune,
        "supervised cloze fine-tuning (standalone or pooled data)",
    )
    add_flags(
        f,
        ("--base", None, REQUIRED, "base model run folder"),
        ("--data", "append", REQUIRED, "SFT folder (repeat)"),
        ("--out", None, REQUIRED, "run folder"),
        ("--method", list(METHODS), Method.name, "full weights or LoRA adapters"),
        *LORA_FLAGS,
        QUIET,
        DATA_PARALLEL,
    )
    add_train_args(f, steps=200)
    add_flags(f.add_argument_group("across centres"), *SYNC_FLAGS)
