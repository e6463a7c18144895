"""The ``aisyn`` command: parses arguments, then calls one function per subcommand.

Errors the user can fix (bad input, missing files, mismatched data) print one
line ``aisyn: error: ...`` and exit with status 2, bad flags already while
parsing (``aisyn.validate`` holds their types); running out of memory prints
one line and exits with status 1; anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
from pathlib import Path

from aisyn import validate

log = logging.getLogger("aisyn")

# Modules that add their own subcommands: each has register(subparsers).
EXTENSIONS = ("aisyn.split.cli", "aisyn.fl.cli", "aisyn.experiments.cli")


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, ensure_ascii=False))


# --- data ---------------------------------------------------------------------


def cmd_tokenizer_train(args) -> None:
    from aisyn.data.corpora import load_corpora
    from aisyn.data.tokenizer import train_tokenizer

    corpus = load_corpora(args.corpus)
    texts = [d.text for d in corpus.split("train")]
    tok = train_tokenizer(texts, args.vocab_size, args.out)
    print(
        f"wrote {args.out}: vocab {tok.vocab_size}, eod id {tok.eod_id}, "
        f"sha256 {tok.sha256[:16]}, trained on {len(texts)} train documents"
    )


def cmd_prepare(args) -> None:
    from aisyn.data.corpora import load_corpora, portable_specs
    from aisyn.data.shards import prepare
    from aisyn.data.tokenizer import PanguTokenizer

    tok = PanguTokenizer.load(args.tokenizer)
    corpus = load_corpora(args.corpus)
    m = prepare(
        corpus,
        tok,
        args.seq_len,
        args.out,
        max_documents=args.max_docs,
        overwrite=args.overwrite,
        corpus_specs=portable_specs(args.corpus),
    )
    for split, s in m["splits"].items():
        print(
            f"{split:5s}: {s['documents']:6d} documents  {s['tokens']:9d} tokens  "
            f"{s['samples']:6d} samples of {m['sample_len']}"
        )
    print(f"wrote {args.out}/manifest.json (tokenizer {tok.sha256[:12]})")


def cmd_cloze_build(args) -> None:
    from aisyn.data.cloze import build_items, write_items
    from aisyn.data.corpora import load_corpora

    items = build_items(
        load_corpora(args.corpus),
        args.split,
        per_document=args.per_doc,
        seed=args.seed,
        max_documents=args.max_docs,
    )
    n = write_items(items, args.out)
    print(f"wrote {n} cloze items to {args.out}")


# --- training and evaluation --------------------------------------------------


def cmd_train(args) -> None:
    from aisyn.train.flags import train_config_from_args
    from aisyn.train.loop import train

    if args.resume:
        validate.check_resumable(args.out)
    summary = train(
        args.model,
        args.data,
        args.out,
        train_config_from_args(args),
        resume=args.resume,
        init_from=args.init_from,
        progress=not args.quiet,
        tensorboard=args.tensorboard,
    )
    print(
        f"final loss {summary['final_loss']:.4f} after {summary['steps']} steps "
        f"({summary['tokens']} tokens, {summary['elapsed_s']:.1f} s)"
    )
    print(f"run folder: {summary['run']}  loss plot: {summary['plot']}")


def cmd_eval(args) -> None:
    from aisyn.eval.flags import eval_options
    from aisyn.eval.report import evaluate_run, summary_lines
    from aisyn.split.evaluate import evaluate_split_run
    from aisyn.train.run import RunDir

    options = eval_options(args)
    # A split run holds only the data party's half: evaluate it through the link.
    split = RunDir(args.run).read_config().get("kind") == "split"
    evaluate = evaluate_split_run if split else evaluate_run
    res = evaluate(args.run, **options)
    for line in summary_lines(res):
        print(line)
    print(f"wrote {Path(args.run) / 'eval.json'}")


def cmd_demo(args) -> None:
    from aisyn.demo import run_demo
    from aisyn.eval.report import summary_lines

    res = run_demo(
        args.out,
        steps=args.steps,
        max_docs=args.max_docs,
        model=args.model,
        overwrite=args.overwrite,
    )
    for line in summary_lines(res["eval"]):
        print(line)
    print(f"loss plot: {res['plot']}")


# --- parser ---------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from aisyn.eval.flags import add_eval_args
    from aisyn.train.flags import add_train_args

    p = argparse.ArgumentParser(
        prog="aisyn",
        description="Split (pipeline) and federated training of PanGu-α across "
        "organisations that cannot pool their data.",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser(
        "demo",
        help="prepare news data, train the tiny model, evaluate",
        description="The embedded default job: prepares a slice of "
        "the news corpus, trains the tiny PanGu-α on CPU, evaluates "
        "test loss and cloze accuracy, and plots the loss.",
    )
    d.add_argument("--out", default="runs/demo", help="folder for data and run")
    d.add_argument("--steps", type=validate.positive_int, default=1000)
    d.add_argument(
        "--max-docs",
        type=validate.positive_int,
        default=8000,
        help="documents of the news corpus to use",
    )
    d.add_argument("--model", default="tiny")
    d.add_argument(
        "--overwrite", action="store_true", help="replace an earlier demo in --out"
    )
    d.set_defaults(func=cmd_demo)

    t = sub.add_parser("tokenizer", help="train a PanGu-recipe tokenizer")
    tsub = t.add_subparsers(dest="tokenizer_command", required=True, metavar="ACTION")
    tt = tsub.add_parser(
        "train",
        help="jieba + SentencePiece on corpora",
        description="Train a SentencePiece unigram model on the "
        "jieba-segmented train split of the given corpora.",
    )
    tt.add_argument(
        "--corpus",
        nargs="+",
        default=["news", "reviews"],
        help="news, reviews, or .txt/.jsonl files",
    )
    tt.add_argument("--vocab-size", type=validate.positive_int, default=8000)
    tt.add_argument("--out", required=True, help="output .model file")
    tt.set_defaults(func=cmd_tokenizer_train)

    pr = sub.add_parser(
        "prepare",
        help="tokenise corpora into token shards",
        description="Tokenise documents into memory-mapped shards "
        "of seq_len+1 tokens per split (train/valid/test by a hash "
        "of each document).",
    )
    pr.add_argument(
        "--corpus", nargs="+", required=True, help="news, reviews, or .txt/.jsonl files"
    )
    pr.add_argument("--out", required=True, help="output folder")
    pr.add_argument(
        "--tokenizer",
        default=None,
        help="shipped tokenizer name (default zh8k) or a .model file, "
        "e.g. PanGu's vocab.model",
    )
    pr.add_argument("--seq-len", type=validate.positive_int, default=128)
    pr.add_argument(
        "--max-docs",
        type=validate.positive_int,
        default=None,
        help="use only the first N documents",
    )
    pr.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing folder (built beside it, then swapped)",
    )
    pr.set_defaults(func=cmd_prepare)

    tr = sub.add_parser(
        "train",
        help="standalone (unsplit) training",
        description="Train PanGu-α on prepared data; writes "
        "config.json, metrics.jsonl, loss.png and checkpoints to --out.",
    )
    tr.add_argument(
        "--model",
        default="tiny",
        help="preset (tiny, small, 350M, 2.6B, 13B, 200B) or JSON file",
    )
    tr.add_argument(
        "--data",
        action="append",
        required=True,
        help="prepared data folder (repeat to pool several)",
    )
    tr.add_argument("--out", required=True, help="run folder")
    tr.add_argument(
        "--init-from",
        default=None,
        help="start from a run folder or checkpoint instead of random init",
    )
    tr.add_argument("--quiet", action="store_true", help="no progress bar")
    add_train_args(tr)
    tr.set_defaults(func=cmd_train)

    ev = sub.add_parser(
        "eval",
        help="test loss, perplexity and cloze accuracy",
        description="Evaluate a run's latest checkpoint; writes RUN/eval.json.",
    )
    ev.add_argument("--run", required=True)
    add_eval_args(ev)
    ev.set_defaults(func=cmd_eval)

    c = sub.add_parser("cloze", help="build cloze items")
    csub = c.add_subparsers(dest="cloze_command", required=True, metavar="ACTION")
    cb = csub.add_parser(
        "build",
        help="cloze items from a corpus split",
        description="Blank a repeated noun in each document; "
        "candidates are 10 nouns of the document/domain.",
    )
    cb.add_argument("--corpus", nargs="+", required=True)
    cb.add_argument("--split", choices=["train", "valid", "test"], default="test")
    cb.add_argument("--out", required=True, help="output .jsonl")
    cb.add_argument(
        "--per-doc",
        type=validate.positive_int,
        default=1,
        help="items per document (each blanks a different noun)",
    )
    cb.add_argument("--max-docs", type=validate.positive_int, default=None)
    cb.add_argument("--seed", type=validate.nonneg_int, default=0)
    cb.set_defaults(func=cmd_cloze_build)

    for name in EXTENSIONS:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        mod.register(sub)
    return p


def _terminate(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s:%(name)s:%(message)s",
    )
    for noisy in ("matplotlib", "jieba", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from aisyn.errors import USER_ERRORS

    # SIGTERM ends the command like Ctrl-C does: through the ``finally`` blocks
    # that stop the processes it started (Flower's SuperLink and SuperNodes, a
    # spawned compute party), instead of leaving them running.
    signal.signal(signal.SIGTERM, _terminate)
    try:
        args.func(args)
    except USER_ERRORS as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"aisyn: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("aisyn: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        # Running out of memory despite the up-front estimate is the machine's
        # limit, not a bug: one line, and what to lower.
        if not _out_of_memory(e):
            raise
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(
            f"aisyn: error: out of memory ({first}); lower --micro-batch-size "
            "or --batch-size",
            file=sys.stderr,
        )
        return 1
    return 0


def _out_of_memory(e: BaseException) -> bool:
    if isinstance(e, MemoryError):
        return True
    torch = sys.modules.get("torch")  # only loaded if the command used it
    oom = getattr(torch, "OutOfMemoryError", None)
    return oom is not None and isinstance(e, oom)


if __name__ == "__main__":
    sys.exit(main())
