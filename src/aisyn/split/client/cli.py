"""The data party's commands: ``aisyn split train|eval|generate|merge``."""

from __future__ import annotations

import argparse
import logging
import os

from aisyn import procs, validate
from aisyn.eval.flags import add_eval_args, add_generate_args
from aisyn.flagtable import (
    QUIET,
    REQUIRED,
    add_command,
    add_config_flag,
    add_flags,
    init_from_flag,
    model_flag,
)
from aisyn.setting import flag_rows, from_args
from aisyn.split.defence.cut_dp import DEFENCES, RECOMMENDED
from aisyn.split.flags import add_link_args, link_settings, timeout_type
from aisyn.split.options import SplitOptions
from aisyn.split.transport import (
    DATA_PARTY_RECV_TIMEOUT_S,
)
from aisyn.train.flags import LORA_FLAGS, add_train_args
from aisyn.train.lora import METHODS, Method
from aisyn.validate import (
    nonneg_float,
    open_probability,
    positive_float,
    positive_int,
)

log = logging.getLogger("aisyn.split")


def _peer(args):
    """The compute party --peer names, with the link's flags (None: not given)."""
    return link_settings(args, args.peer) if args.peer else None


def cmd_train(args) -> None:
    """Writes a run folder like `aisyn train` (A's half of the model; metrics add
    link bytes per step). --mode local runs the compute party in this process;
    --mode grpc dials --peer or, with --spawn-backbone, starts one on this
    machine. With --sft instead of --data it fine-tunes --init-from BASE on
    supervised items as `aisyn finetune` does (the compute party is unchanged);
    --method / --compute-method lora train LoRA adapters on either party's
    blocks instead, the base frozen. Under torchrun the data party's blocks are
    FSDP2-sharded over the ranks, each running its share of every micro-batch's
    rows; rank 0 alone holds the data, the run folder and the link
    (docs/split.md)."""

    from aisyn.split.client.data_ranks import (
        DataRanks,
        DataRanksFailed,
        end_words,
        follow,
    )
    from aisyn.train import distributed
    from aisyn.train.device import resolve_device

    ranks = None
    if distributed.under_torchrun():
        procs.end_with_parent()  # a rank never outlives its torchrun agent
    if distributed.world_size() > 1:
        # torchrun: A's blocks sharded over the ranks, each micro-batch's rows
        # shared; rank 0 alone holds the data, the run folder and the link.
        ranks, device = DataRanks.join(resolve_device(args.device), args.recv_timeout)
        ranks.check_shared(args.out, "data party")
        if ranks.rank != 0:
            follow(ranks, device)
            return
        args.device = str(device)
    if ranks is None:
        _train_rank0(args, None)
        return
    try:
        _train_rank0(args, ranks)
    except BaseException as e:
        if not (isinstance(e, SystemExit) or procs.terminated()):
            if not ranks.busy:  # the other ranks wait for a word: the end
                end_words(ranks, e)
            raise
        # SIGTERM, from torchrun when another rank ended (or the job was
        # stopped); its SystemExit may surface as another error (procs.terminated)
        raise DataRanksFailed(
            "the data party's ranks fell out of step: torchrun stopped rank 0 "
            "(a rank ended, or the job was stopped); the last checkpoint is "
            "intact (resume with --resume)"
        ) from e
    end_words(ranks)


def _train_rank0(args, ranks) -> None:
    """``cmd_train`` in one process, or on rank 0 of a data party's job."""
    from aisyn.split.client.train import secret_seed, split_train
    from aisyn.split.defence.cut_dp import (
        CutDefence,
        defence_from_flags,
        undefended_warning,
    )
    from aisyn.train.flags import (
        print_summary,
        resume_from_args,
        train_config_from_args,
    )
    from aisyn.train.lora import Method

    defence = defence_from_flags(
        forward_clip=args.dp_forward_clip,
        forward_noise=args.dp_forward_noise,
        backward_clip=args.dp_backward_clip,
        backward_noise=args.dp_backward_noise,
        delta=args.dp_delta,
        embedding_dp=args.embedding_dp,
        named=args.defence,
        bottleneck_floor=args.bottleneck_floor,
        bottleneck_beta=args.bottleneck_beta,
    )
    if not defence.active:  # --defence none: its first line says so
        log.warning("%s", undefended_warning(args.backbone == "frozen"))
    args.resume = resume_from_args(args, None)
    if args.seed is None:
        args.seed = secret_seed(args.out, args.resume)
    elif args.seed < 2**32:
        log.warning(
            "--seed %d: a seed the compute party can guess lets it rebuild your "
            "initial weights and invert what you send it, and remove a cut "
            "defence's noise, which is drawn from the seed; leave --seed out for "
            "a secret random one (recorded in the run's config.json)",
            args.seed,
        )
    if bool(args.data) == bool(args.sft):
        raise ValueError(
            "give --data SHARDS (pre-training) or --sft SFT_DIR (fine-tuning), "
            + ("not both" if args.data else "one of them")
        )
    opts = from_args(
        SplitOptions,
        args,
        peer=_peer(args),
        spawn_insecure=args.insecure and args.spawn_backbone,
        recv_timeout_s=args.recv_timeout,
    )
    summary = split_train(
        args.model,
        args.data or args.sft,
        args.out,
        train_config_from_args(args),
        opts,
        sft=bool(args.sft),
        resume=args.resume,
        init_from=args.init_from,
        progress=not args.quiet,
        tensorboard=args.tensorboard,
        method=Method(args.method, rank=args.lora_rank, alpha=args.lora_alpha),
        compute_method=Method(
            # a frozen backbone trains nothing: --method is A's alone
            args.compute_method
            or (args.method if args.backbone == "train" else "full"),
            rank=args.lora_rank,
            alpha=args.lora_alpha,
        ),
        defence=defence,
        ranks=ranks,
    )
    if "privacy" in summary:
        eps = summary["privacy"]["dp_epsilon"]
        used = CutDefence.from_dict(summary["privacy"]["defence"])  # calibrated
        print(
            f"cut defence: {used.describe()}; privacy budget ε = "
            + (
                f"{eps:.4g}"
                if eps is not None
                else "unbounded (a side sent without noise)"
            )
            + f" at δ = {used.delta:g} per training row "
            f"({summary['privacy']['releases_per_row']} pass(es) over the data; "
            "privacy.json)"
        )
    print_summary(
        summary,
        f"({summary['tokens']} tokens, {summary['elapsed_s']:.1f} s); link "
        f"{summary['bytes_sent_per_step'] / 1e6:.2f} MB sent and "
        f"{summary['bytes_received_per_step'] / 1e6:.2f} MB received per step",
    )


def cmd_eval(args) -> None:
    """Like `aisyn eval --run` on a split run, optionally against another compute
    party address than the one recorded."""

    from aisyn.eval.flags import eval_options
    from aisyn.eval.report import summary_lines
    from aisyn.split.client.evaluate import evaluate_split_run

    options = eval_options(args)
    res = evaluate_split_run(args.run, peer=_peer(args), **options)
    for line in summary_lines(res):
        print(line)
    print(f"wrote {os.path.join(args.run, 'eval.json')}")


def cmd_generate(args) -> None:
    """Continue --prompt with a split run's data-party folder, like `aisyn
    generate`: the compute party runs its middle blocks (each party with its
    own KV cache); the prompt, the tokens and the text never leave this party,
    only the new positions' hidden states cross. The compute party is reached
    as recorded in the run, or --peer (gRPC), or --mode local (the in-process
    one of a --mode local run). Streams the completion to stdout."""

    import sys

    from aisyn.eval.flags import sampling_from_args
    from aisyn.split.client.generate import split_generate
    from aisyn.train.device import resolve_device

    sampling = sampling_from_args(args)
    if args.mode == "local" and args.peer:
        raise ValueError("--peer needs --mode grpc")
    peer = _peer(args)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    split_generate(
        args.run,
        args.prompt,
        args.max_new_tokens,
        sampling=sampling,
        device=resolve_device(args.device),
        peer=peer,
        mode=args.mode,
        write=write,
    )
    sys.stdout.write("\n")


def cmd_merge(args) -> None:
    """Combines the data party's and compute party's checkpoints of the same step
    into a run folder `aisyn eval` and `load_run_model` read."""

    from aisyn.split.client.merge import merge

    folder = merge(args.data_party, args.compute_party, args.out, step=args.step)
    print(f"merged checkpoint: {folder}  (run folder {args.out})")


def _add_train(ssub: argparse._SubParsersAction) -> None:
    t = add_command(
        ssub,
        "train",
        cmd_train,
        "train as the data party (in-process or against a compute party)",
    )
    add_flags(
        t,
        model_flag("tiny"),
        ("--data", "append", None, "prepared data (pre-training; repeat)"),
        (
            "--sft",
            "append",
            None,
            "SFT folder from `aisyn prepare-sft` instead of --data: fine-tune "
            "--init-from BASE, the loss on its supervised tokens (repeat)",
        ),
        ("--out", None, REQUIRED, "run folder"),
        ("--peer", validate.host_port, None, "compute party HOST:PORT (grpc)"),
        *flag_rows(SplitOptions),
    )
    t.add_argument(
        "--recv-timeout",
        type=timeout_type,
        default=DATA_PARTY_RECV_TIMEOUT_S,
        metavar="SECONDS",
        help="fail if the compute party, still connected, sends nothing for this "
        "long: covers its compute for a step and its checkpoint writes (default "
        "%(default)g; 0 or none: wait forever; a lost connection fails in seconds "
        "regardless)",
    )
    add_flags(
        t,
        init_from_flag(
            "; A loads only its tensors, and the compute party must start from "
            "the same base (local and spawned ones are given it)"
        ),
        QUIET,
        (
            "--method",
            list(METHODS),
            Method.name,
            "the data party's blocks: train them (full) or LoRA adapters on "
            "them, the base frozen (needs --init-from or --model hf:DIR)",
        ),
        (
            "--compute-method",
            list(METHODS),
            None,
            "the compute party's blocks (default: --method); lora keeps its "
            "copy of the base unchanged and its checkpoints small",
        ),
        *LORA_FLAGS,
        (
            "--defence",
            list(DEFENCES),
            None,
            "recommended (the default when no --dp-* flag is given): noise on "
            f"what crosses (σ {RECOMMENDED.forward:g} on the activations, "
            f"{RECOMMENDED.backward:g} on the gradient, if one crosses), clipping "
            "bounds calibrated on built-in public text at the start; none: "
            "undefended, B can read most of the text and labels "
            "(docs/privacy.md); instead of the --dp-* flags",
        ),
        (
            "--dp-forward-clip",
            positive_float,
            None,
            "defence: clip each row of the activations A sends to this L2 norm "
            "(docs/privacy.md)",
        ),
        (
            "--dp-forward-noise",
            nonneg_float,
            None,
            "defence: add Gaussian noise of std NOISE x the forward clip",
        ),
        (
            "--dp-backward-clip",
            positive_float,
            None,
            "defence: clip each row of the gradient A returns to this L2 norm",
        ),
        (
            "--dp-backward-noise",
            nonneg_float,
            None,
            "defence: add Gaussian noise of std NOISE x the backward clip",
        ),
        (
            "--dp-delta",
            open_probability,
            None,
            "the delta the privacy budget epsilon is given at (default 1e-5)",
        ),
        (
            "--embedding-dp",
            positive_float,
            None,
            "the reference's EmbeddingDP on the activations: 1-bit quantisation "
            "and randomized response with this epsilon per bit",
        ),
        (
            "--bottleneck-floor",
            positive_float,
            None,
            "a trained bottleneck on the activations instead of their noise: "
            "each token centred and clipped, noise A learns and never below "
            "this floor (in units of a full token per coordinate; "
            "docs/privacy.md); with the default defence or --dp-backward-*",
        ),
        (
            "--bottleneck-beta",
            nonneg_float,
            None,
            "the weight of the bottleneck's capacity term in A's loss (default 0.01)",
        ),
    )
    add_link_args(t, server=False)
    add_train_args(t)
    # A split run's seed is secret unless given (see split.client.train.secret_seed).
    t.set_defaults(seed=None)
    add_config_flag(t, "split-train")


def _add_eval(ssub: argparse._SubParsersAction) -> None:
    e = add_command(ssub, "eval", cmd_eval, "evaluate a split run through the link")
    add_flags(
        e,
        ("--run", None, REQUIRED, "the data party's run folder"),
        ("--peer", validate.host_port, None, "override the compute party"),
    )
    add_eval_args(e)
    add_link_args(e, server=False)


def _add_generate(ssub: argparse._SubParsersAction) -> None:
    gen = add_command(
        ssub, "generate", cmd_generate, "continue a prompt through the link"
    )
    add_flags(
        gen,
        ("--run", None, REQUIRED, "the data party's run folder"),
        (
            "--mode",
            ["local", "grpc"],
            None,
            "local: the run's in-process compute party; grpc: --peer, or the "
            "recorded one (default: as the run was trained)",
        ),
        ("--peer", validate.host_port, None, "override the compute party"),
    )
    add_generate_args(gen)
    add_link_args(gen, server=False)


def _add_merge(ssub: argparse._SubParsersAction) -> None:
    m = add_command(
        ssub,
        "merge",
        cmd_merge,
        "merge both parties' checkpoints into one ordinary run",
    )
    add_flags(
        m,
        ("--data-party", None, REQUIRED, "A's run folder"),
        (
            "--compute-party",
            None,
            REQUIRED,
            "B's run folder, or the --out root it served from",
        ),
        ("--out", None, REQUIRED, "new run folder"),
        ("--step", positive_int, None, "default: newest common step"),
    )


def register(ssub: argparse._SubParsersAction) -> None:
    """Add the data party's commands to ``aisyn split``."""
    for add in (
        _add_train,
        _add_eval,
        _add_generate,
        _add_merge,
    ):
        add(ssub)
