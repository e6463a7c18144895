"""The ``aisyn`` command: parses arguments, then calls one function per subcommand.

Errors the user can fix (bad input, missing files, mismatched data) print one
line ``aisyn: error: ...`` and exit with status 2, bad flags already while
parsing (``aisyn.validate`` holds their types); running out of memory prints
one line and exits with status 1; anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from aisyn import procs, validate

log = logging.getLogger("aisyn")


# --- data ---------------------------------------------------------------------


def cmd_tokenizer_train(args) -> None:
    """Train a SentencePiece unigram model on the jieba-segmented train split
    of the given corpora."""

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
    """Tokenise documents into memory-mapped shards of seq_len+1 tokens per split
    (train/valid/test by a hash of each document)."""

    from aisyn.data.corpora import load_corpora, portable_specs
    from aisyn.data.shards import prepare
    from aisyn.data.tokenizer import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
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
    """Blank a repeated noun in each document; candidates are 10 nouns of the
    document/domain."""

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


def cmd_certs(args) -> None:
    """Development credentials for a first run across two machines: a fresh CA
    (ca.pem; its key ca.key only with --keep-ca-key), the certificate and key
    of party B, the compute
    party or federated server (b.pem, b.key, valid for each --host), those of
    party A, the data party or a client (a.pem, a.key), and a random shared
    token (token). The names are the ones docs/split.md uses; keys and the
    token are written 0600, never through a link. With --client NAME, one
    more client certificate (NAME.pem, NAME.key) signed by the CA already in
    --out: one per tenant of a centre. For experiments only: production
    brings its own PKI."""

    from aisyn.link.certs import (
        DevCerts,
        check_targets,
        make_dev_certs,
        write_token,
    )

    out = Path(args.out)
    if args.client:
        if args.host:
            raise ValueError(
                "--host names B's certificate; --client signs client "
                "certificates only (leave --host out)"
            )
        _issue_clients(out, args)
        return
    paths = DevCerts.for_parties(out)
    token = out / "token"
    # Every target checked before anything is generated or written.
    # The CA's key is written only when asked for: whoever holds it can sign a
    # certificate for B's name or pose as any tenant, and the quick start
    # copies this folder to both parties.
    targets = [*paths.files(), token] + ([paths.ca_key] if args.keep_ca_key else [])
    check_targets(targets, overwrite=args.overwrite)
    hosts = args.host or ["127.0.0.1", "localhost"]
    make_dev_certs(
        out,
        hosts,
        days=args.days,
        paths=paths,
        keep_ca_key=args.keep_ca_key,
        overwrite=args.overwrite,
    )
    write_token(token, overwrite=args.overwrite)
    ca = "ca.pem + ca.key (the CA; keep ca.key here)" if args.keep_ca_key else "ca.pem"
    print(
        f"wrote {out}/: {ca}, b.pem + "
        f"b.key (compute party / server, for {', '.join(hosts)}), a.pem + a.key "
        "(data party / client), token"
    )
    print(
        f"B: --tls-cert {paths.server_cert} --tls-key {paths.server_key} "
        f"--tls-ca {paths.ca_cert} --token-file {token}"
    )
    print(
        f"A: --tls-cert {paths.client_cert} --tls-key {paths.client_key} "
        f"--tls-ca {paths.ca_cert} --token-file {token}"
    )
    if args.keep_ca_key:
        print(f"more clients (a tenant each): aisyn certs --out {out} --client NAME")


def _issue_clients(out: Path, args) -> None:
    from aisyn.link.certs import check_targets, issue_client

    names = list(dict.fromkeys(args.client))
    # All of them refused before any is written.
    check_targets(
        [out / f"{n}{ext}" for n in names for ext in (".pem", ".key")],
        overwrite=args.overwrite,
    )
    for name in names:
        c = issue_client(out, name, days=args.days, overwrite=args.overwrite)
        print(
            f"wrote {c.cert} + {c.key} (client {c.subject}, signed by "
            f"{c.ca_cert}, valid until {c.not_after:%Y-%m-%d %H:%M} UTC)"
        )
        print(
            f'  tenants file: [tenant.{name}] certificate = "{c.fingerprint}"  '
            f'(or subject = "{c.subject}")'
        )
        print(f"  {name}: --tls-cert {c.cert} --tls-key {c.key} --tls-ca {c.ca_cert}")


def _cert_host(text: str) -> str:
    """A ``--host`` for a certificate: an IP address or an ASCII DNS name (a
    certificate holds names in their ASCII form)."""
    import ipaddress
    import re

    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        pass
    if not re.fullmatch(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?", text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither an IP address nor an ASCII host name"
        )
    return text


def _cert_days(text: str) -> int:
    """``aisyn certs --days``: a whole number of days X.509 can express."""
    from aisyn.link.certs import check_days

    days = validate.positive_int(text)
    try:
        check_days(days)
    except ValueError as e:
        message = str(e).removeprefix(f"--days {days}: ")
        raise argparse.ArgumentTypeError(message) from None
    return days


def _client_name(text: str) -> str:
    """``aisyn certs --client``: a plain name, as a tenant's (its file names
    and the certificate's CN)."""
    from aisyn.link.certs import check_client_name

    try:
        check_client_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("client ")) from None
    return text


# --- training and evaluation --------------------------------------------------


def cmd_train(args) -> None:
    """Train PanGu-α on prepared data; writes config.json, metrics.jsonl, loss.png
    and checkpoints to --out."""

    from aisyn.train.flags import job_from_args, print_summary, train_config_from_args
    from aisyn.train.pretrain import train

    summary = train(
        args.model,
        args.data,
        args.out,
        train_config_from_args(args),
        init_from=args.init_from,
        **job_from_args(args),
    )
    print_summary(
        summary, f"({summary['tokens']} tokens, {summary['elapsed_s']:.1f} s)"
    )


def cmd_eval(args) -> None:
    """Evaluate a run's latest checkpoint; writes RUN/eval.json."""

    from aisyn.eval.flags import eval_options
    from aisyn.eval.report import evaluate_run, summary_lines
    from aisyn.split.client.evaluate import evaluate_split_run
    from aisyn.train.run import RunDir

    options = eval_options(args)
    # A split run holds only the data party's half: evaluate it through the link.
    split = RunDir(args.run).read_config().get("kind") == "split"
    evaluate = evaluate_split_run if split else evaluate_run
    res = evaluate(args.run, **options)
    for line in summary_lines(res):
        print(line)
    print(f"wrote {Path(args.run) / 'eval.json'}")


def cmd_generate(args) -> None:
    """Continue --prompt with a run's latest checkpoint, or with a Hugging Face
    folder (--model hf:DIR), greedy unless --temperature > 0, streaming the
    completion to stdout as it is produced; everything else goes to stderr, so
    stdout holds the completion alone."""

    from aisyn.eval.flags import sampling_from_args
    from aisyn.eval.generate import load_generator, load_pretrained_generator
    from aisyn.model.families import hf_folder

    sampling = sampling_from_args(args)
    if (args.run is None) == (args.model is None):
        raise ValueError("give --run RUN or --model hf:DIR (one of them)")
    if args.model is not None:
        folder = hf_folder(args.model)
        if folder is None:
            raise ValueError(
                f"--model {args.model}: give hf:DIR, a Hugging Face model folder "
                "(a run folder goes with --run)"
            )
        gen = load_pretrained_generator(folder, args.device)
    else:
        gen = load_generator(args.run, args.device)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    gen.complete(args.prompt, args.max_new_tokens, sampling=sampling, write=write)
    sys.stdout.write("\n")


def cmd_demo(args) -> None:
    """The embedded default job: prepares a slice of the news corpus, trains the
    tiny PanGu-α on CPU, evaluates test loss and cloze accuracy, and plots the
    loss."""

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
    done = res["completion"]
    print(f"greedy completion of {done['prompt']!r}:")
    print(done["text"])


# --- parser ---------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from aisyn import convert
    from aisyn.eval.flags import add_eval_args, add_generate_args
    from aisyn.experiments import cli as experiments_cli
    from aisyn.fl import cli as fl_cli
    from aisyn.flagtable import (
        QUIET,
        REQUIRED,
        Parser,
        add_command,
        add_config_flag,
        add_flags,
        add_group,
        init_from_flag,
        model_flag,
    )
    from aisyn.privacy import cli as privacy_cli
    from aisyn.split import cli as split_cli
    from aisyn.train.flags import DATA_PARALLEL, SYNC_FLAGS, add_train_args
    from aisyn.validate import positive_int

    p = Parser(
        prog="aisyn",
        description="Split (pipeline) and federated training of PanGu-α across "
        "organisations that cannot pool their data.",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # A command's --help description is its cmd_* function's docstring.

    d = add_command(
        sub, "demo", cmd_demo, "prepare news data, train the tiny model, evaluate"
    )
    add_flags(
        d,
        ("--out", None, "runs/demo", "folder for data and run"),
        ("--steps", positive_int, 1000, "optimizer steps"),
        ("--max-docs", positive_int, 8000, "documents of the news corpus to use"),
        model_flag("tiny"),
        ("--overwrite", "store_true", None, "replace an earlier demo in --out"),
    )

    corpus_help = "news, reviews, or .txt/.jsonl files"
    tsub = add_group(sub, "tokenizer", "train a PanGu-recipe tokenizer")
    tt = add_command(
        tsub, "train", cmd_tokenizer_train, "jieba + SentencePiece on corpora"
    )
    tt.add_argument(
        "--corpus", nargs="+", default=["news", "reviews"], help=corpus_help
    )
    add_flags(
        tt,
        ("--vocab-size", positive_int, 8000, "pieces in the SentencePiece model"),
        ("--out", None, REQUIRED, "output .model file"),
    )

    pr = add_command(sub, "prepare", cmd_prepare, "tokenise corpora into token shards")
    pr.add_argument("--corpus", nargs="+", required=True, help=corpus_help)
    add_flags(
        pr,
        ("--out", None, REQUIRED, "output folder"),
        (
            "--tokenizer",
            None,
            None,
            "shipped tokenizer name (default zh8k), a .model file (e.g. PanGu's "
            "vocab.model), hf:DIR (a Hugging Face model folder's tokenizer.json, "
            "for --model hf:DIR) or a tokenizer.json file",
        ),
        ("--seq-len", positive_int, 128, "tokens per sample (one more is stored)"),
        ("--max-docs", positive_int, None, "use only the first N documents"),
        (
            "--overwrite",
            "store_true",
            None,
            "replace an existing folder (built beside it, then swapped)",
        ),
    )

    ce = add_command(
        sub, "certs", cmd_certs, "development TLS certificates and a token"
    )
    add_flags(
        ce,
        ("--out", None, REQUIRED, "folder to write them to"),
        ("--days", _cert_days, 30, "days the certificates are valid"),
        ("--overwrite", "store_true", None, "replace credentials already there"),
    )
    ce.add_argument(
        "--host",
        action="append",
        type=_cert_host,
        help="name or address B is reached at (repeat; default 127.0.0.1 and "
        "localhost)",
    )
    ce.add_argument(
        "--keep-ca-key",
        action="store_true",
        help="also write the CA's key (ca.key, 0600) so that `--client` can sign "
        "more client certificates later; keep it on the issuing machine only",
    )
    ce.add_argument(
        "--client",
        action="append",
        type=_client_name,
        metavar="NAME",
        help="sign one more client certificate (NAME.pem, NAME.key) with the CA "
        "an earlier `aisyn certs --keep-ca-key` left in --out (repeat): one per "
        "tenant",
    )

    tr = add_command(sub, "train", cmd_train, "standalone (unsplit) training")
    add_flags(
        tr,
        model_flag("tiny"),
        ("--data", "append", REQUIRED, "prepared data folder (repeat to pool several)"),
        ("--out", None, REQUIRED, "run folder"),
        init_from_flag(),
        QUIET,
        DATA_PARALLEL,
    )
    add_train_args(tr)
    add_flags(tr.add_argument_group("across centres"), *SYNC_FLAGS)
    add_config_flag(tr, "train")

    ev = add_command(sub, "eval", cmd_eval, "test loss, perplexity and cloze accuracy")
    ev.add_argument("--run", required=True, help="run folder (its latest checkpoint)")
    add_eval_args(ev)

    g = add_command(sub, "generate", cmd_generate, "continue a prompt with a run")
    add_flags(
        g,
        ("--run", None, None, "run folder (its latest checkpoint)"),
        (
            "--model",
            None,
            None,
            "instead of --run: hf:DIR, a Hugging Face model folder with its "
            "tokenizer.json",
        ),
    )
    add_generate_args(g)

    csub = add_group(sub, "cloze", "build cloze items")
    cb = add_command(csub, "build", cmd_cloze_build, "cloze items from a corpus split")
    cb.add_argument("--corpus", nargs="+", required=True, help=corpus_help)
    add_flags(
        cb,
        ("--split", ["train", "valid", "test"], "test", "corpus split to blank"),
        ("--out", None, REQUIRED, "output .jsonl"),
        (
            "--per-doc",
            positive_int,
            1,
            "items per document (each blanks a different noun)",
        ),
        ("--max-docs", positive_int, None, "use only the first N documents"),
        ("--seed", validate.seed, 0, "seed of the blanks and candidates"),
    )

    # The packages that add their own subcommands.
    for module in (split_cli, fl_cli, experiments_cli, convert, privacy_cli):
        module.register(sub)
    return p


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

    procs.end_on_sigterm()
    try:
        args.func(args)
    except SystemExit:
        if procs.terminated() is None:
            raise
        # Returned, not raised: a torchrun rank must end through exit_rank.
        return 128 + procs.terminated()
    except USER_ERRORS as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        # A job of several ranks prints the line once: the first rank to stop
        # on it; the others' failures follow from it (_rank_failure).
        if not _several_ranks() or _first_to_stop():
            print(f"aisyn: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("aisyn: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if procs.terminated() is not None:  # SIGTERM's exit, raised in an import
            log.debug("terminated", exc_info=True)
            return 128 + procs.terminated()
        if _several_ranks():
            code = _rank_failure(e)
            if code is not None:
                return code
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


def _several_ranks() -> bool:
    """Whether this process is one rank of a job of several (torchrun's)."""
    return os.environ.get("WORLD_SIZE", "1") != "1"


def _first_to_stop() -> bool:
    """Whether this rank is the first of its job to stop on a one-line error
    (a later one's may well follow from the first's: a peer gone)."""
    from aisyn.train import distributed

    return distributed.claim_stop()


def _rank_failure(e: BaseException) -> int | None:
    """A rank's exit status, its one line printed if any, when ``e`` is the
    job falling apart rather than a bug of this rank: another rank stopped on
    a one-line error (that rank printed it: this one stays quiet), or a peer
    went away (one line naming it); None otherwise (a bug: its traceback)."""
    from aisyn.train import distributed

    if distributed.stopped_by_another():
        log.debug("another rank stopped the job; this one's failure", exc_info=True)
        return 2
    if distributed.peer_lost(e):
        first = str(e).strip().splitlines()[0]
        print(
            f"aisyn: error: rank {distributed.rank()}: another rank of the job went "
            f"away ({first}); see that rank's output",
            file=sys.stderr,
        )
        return 1
    return None


# How torch's CPU allocator (a plain RuntimeError) and numpy word a failed
# allocation; CUDA's is torch.OutOfMemoryError.
_ALLOCATION_FAILED = (
    "can't allocate memory",
    "Unable to allocate",
    "not enough memory",
)


def _out_of_memory(e: BaseException) -> bool:
    if isinstance(e, MemoryError):
        return True
    if isinstance(e, RuntimeError) and any(s in str(e) for s in _ALLOCATION_FAILED):
        return True
    torch = sys.modules.get("torch")  # only loaded if the command used it
    oom = getattr(torch, "OutOfMemoryError", None)
    return oom is not None and isinstance(e, oom)


def console() -> None:
    """The ``aisyn`` command (and ``python -m aisyn.cli``): :func:`main`, then
    the exit."""
    code = main()
    # A rank of a multi-process job (torchrun's, or any launcher that sets
    # WORLD_SIZE, as the tests do) ends without the interpreter's teardown,
    # which its backend's threads were seen to abort (procs.exit_rank).
    if "TORCHELASTIC_RUN_ID" in os.environ or os.environ.get("WORLD_SIZE", "1") != "1":
        from aisyn.procs import exit_rank

        exit_rank(code)
    sys.exit(code)


if __name__ == "__main__":
    console()
