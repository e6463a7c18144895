"""``aisyn split plan|train|serve|eval|generate|merge``."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os

from aisyn import procs, validate
from aisyn.eval.flags import add_eval_args, add_generate_args
from aisyn.flagtable import (
    DEVICE,
    QUIET,
    REQUIRED,
    add_command,
    add_config_flag,
    add_flags,
    add_group,
    init_from_flag,
    model_flag,
)
from aisyn.link.codec import CODECS
from aisyn.model.cost import RUNTIME_BYTES, format_bytes
from aisyn.model.memory import SCHEDULES
from aisyn.split.defence.cut_dp import DEFENCES, RECOMMENDED
from aisyn.split.defence.emulator import DEFAULT_BLOCKS as DEFAULT_EMULATOR_BLOCKS
from aisyn.split.defence.emulator import FRONT_VIA
from aisyn.split.protocol import BACKBONES
from aisyn.split.transport import (
    COMPUTE_PARTY_HELLO_TIMEOUT_S,
    COMPUTE_PARTY_IDLE_TIMEOUT_S,
    DATA_PARTY_CONNECT_TIMEOUT_S,
    DATA_PARTY_RECV_TIMEOUT_S,
    link_options,
    parse_timeout,
)
from aisyn.tls_flags import add_allow_insecure_remote, add_tls_files
from aisyn.train.flags import LORA_FLAGS, add_train_args
from aisyn.train.lora import METHODS, Method
from aisyn.validate import (
    nonneg_float,
    nonneg_int,
    open_probability,
    positive_float,
    positive_int,
)

log = logging.getLogger("aisyn.split")


def _add_link_args(p: argparse.ArgumentParser, *, server: bool) -> None:
    g = p.add_argument_group("link security")
    add_tls_files(
        g,
        cert="this party's certificate (PEM) for mutual TLS",
        key="this party's private key (PEM)",
        ca="CA certificate (PEM) that signed the peer's",
    )
    if not server:
        g.add_argument(
            "--server-name",
            help="name to verify in the server certificate when it differs from "
            "the --peer host",
        )
        g.add_argument(
            "--data-peer",
            type=validate.host_port,
            help="dial the compute party's data plane (when it offers one) at this "
            "HOST:PORT instead of the --peer host and the port it names: for a "
            "proxy or NAT between the parties",
        )
    else:
        g.add_argument(
            "--data-listen",
            type=validate.listen_address,
            help="also offer every session a bulk data plane on HOST:PORT (port 0: "
            "any free): its tensors then travel on two mutual-TLS connections "
            "beside the gRPC stream, near a plain TLS socket's rate; the data "
            "party's firewall must let it reach this port too",
        )
    g.add_argument(
        "--token-file",
        help="file holding the shared token (default: $AISYN_SPLIT_TOKEN)",
    )
    g.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext, no TLS (refused on non-loopback addresses unless "
        "--allow-insecure-remote)",
    )
    add_allow_insecure_remote(
        g, "permit --insecure on a non-loopback address (activations leak data!)"
    )


def _memory(text: str) -> float:
    from aisyn.model.cost import PlanError, parse_bytes

    try:
        value = parse_bytes(text)
    except PlanError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: must be a size above 0 (leave the flag out for no budget)"
        )
    return value


def _timeout(text: str) -> float | None:
    """--recv-timeout / --idle-timeout: seconds, or 0 / none to wait forever."""
    try:
        return parse_timeout(text)
    except ValueError as e:  # argparse prints only this kind's message
        raise argparse.ArgumentTypeError(str(e)) from None


def _settings(args, address: str):
    from aisyn.split.transport import LinkSettings

    return LinkSettings(
        address,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
        server_name=getattr(args, "server_name", None),
        token_file=args.token_file,
        insecure=args.insecure,
        allow_insecure_remote=args.allow_insecure_remote,
        data_address=getattr(args, "data_listen", None)
        or getattr(args, "data_peer", None),
    )


# --- plan ---------------------------------------------------------------------


def cmd_plan(args) -> None:
    """Per party: parameter share, FLOPs share, the step's peak memory (runtime +
    weights + gradients + optimizer + activations; per rank for a party on
    several devices: B's blocks in pipeline stages, or FSDP2-sharded with more
    devices than blocks; A's always sharded), and bytes crossing per
    step; refuses a device set a rank does not fit. Works for any preset (350M
    ... 200B) without allocating it."""

    from aisyn.model.cost import PlanError, parse_bytes
    from aisyn.model.families import load_config
    from aisyn.model.memory import Workload
    from aisyn.model.segments import parse_partition
    from aisyn.split.planner import PartySpec, evaluate, exposure_warning, plan

    cfg = load_config(args.model)
    if args.data:
        from aisyn.data.shards import TokenShards
        from aisyn.train.models import model_config_for

        # the model `aisyn train --data` builds: the data tokenizer's vocabulary
        shards = TokenShards.open(args.data, "train")
        cfg = model_config_for(
            args.model, shards.tokenizer_info, shards.seq_len, args.data
        )
        args.seq_len = args.seq_len or shards.seq_len
    parties = [PartySpec.parse(p) for p in args.party]
    workload = Workload(
        batch_size=args.batch_size,
        micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len,
        dtype=args.dtype,
        codec=args.compress,
        in_flight=max(1, args.pipeline + 1),
        eod_reset=args.eod_reset,
        autocast=args.autocast == "bf16",
        activation_checkpointing=args.activation_checkpointing,
        schedule=args.schedule,
        runtime_bytes=parse_bytes(args.runtime_memory),
    )
    if args.cut:
        by_name = {p.name: p for p in parties}
        if sorted(by_name) != ["A", "B"] or len(parties) != 2:
            raise ValueError("give exactly one --party A:... and one --party B:...")
        result = evaluate(
            args.model, cfg, parse_partition(args.cut, cfg), by_name, workload
        )
        if misfits := result.misfits():
            more = f" (and {len(misfits) - 1} more)" if len(misfits) > 1 else ""
            raise PlanError(f"--cut {args.cut} does not fit: {misfits[0]}{more}")
    else:
        result = plan(
            args.model,
            cfg,
            parties,
            workload,
            shape=args.shape,
            min_a_blocks=args.min_a_blocks,
        )
    warning = exposure_warning(result.partition)
    if warning:
        log.warning("%s", warning)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.render())


# --- train / serve ----------------------------------------------------------------


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
    from aisyn.split.session import SplitOptions
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
    peer = _settings(args, args.peer) if args.peer else None
    opts = SplitOptions(
        cut=args.cut,
        mode=args.mode,
        window=args.pipeline,
        codec=args.compress,
        peer=peer,
        spawn_backbone=args.spawn_backbone,
        spawn_insecure=args.insecure and args.spawn_backbone,
        connect_timeout_s=args.connect_timeout,
        recv_timeout_s=args.recv_timeout,
        backbone=args.backbone,
        front_via=args.front_via,
        emulator_blocks=args.emulator_blocks,
        private_warmup=args.private_warmup,
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


def _metrics_tls(args):
    """--metrics-tls-cert/-key/-ca: all three (the endpoint asks every scraper
    for a client certificate), and only with --metrics-listen."""
    from aisyn.split.centre.metrics_endpoint import MetricsTls

    given = {
        flag: value
        for flag, value in (
            ("--metrics-tls-cert", args.metrics_tls_cert),
            ("--metrics-tls-key", args.metrics_tls_key),
            ("--metrics-tls-ca", args.metrics_tls_ca),
        )
        if value
    }
    if not given:
        return None
    if args.metrics_listen is None:
        raise ValueError(
            f"{', '.join(given)}: there is no --metrics-listen endpoint to secure"
        )
    if len(given) < 3:
        raise ValueError(
            "--metrics-tls-cert, --metrics-tls-key and --metrics-tls-ca go "
            "together (the endpoint's certificate and key, and the CA of its "
            f"scrapers' client certificates); only {', '.join(given)} given"
        )
    return MetricsTls(args.metrics_tls_cert, args.metrics_tls_key, args.metrics_tls_ca)


def cmd_serve(args) -> None:
    """Holds only the middle blocks of --model cut by --cut; takes the
    optimisation settings from each data party's hello; keeps one run folder per
    data-party run under --out. Serves --max-sessions sessions at once (one by
    default) and stays up when a session fails. With --tenants each data owner
    is a tenant: its runs under --out/TENANT, its own quotas. Under torchrun
    the blocks spread over the ranks: pipeline stages, or FSDP2 shards with
    more ranks than blocks (rank 0 alone listens; docs/split.md)."""

    from aisyn.model.families import hf_folder, load_config
    from aisyn.model.segments import parse_partition
    from aisyn.split.backbone.compute_party import ComputeParty
    from aisyn.split.backbone.pipeline import Ranks, serve_ranks
    from aisyn.split.centre.server import SplitServer, return_large_blocks_to_os
    from aisyn.train import distributed
    from aisyn.train.device import resolve_device

    metrics_tls = _metrics_tls(args)  # checked before anything is loaded
    # Before any session's thread allocates: what a session frees goes back
    # to the OS, not into its thread's arena (a centre holds many sessions).
    return_large_blocks_to_os()
    tenants = None
    if args.tenants:  # checked before anything is loaded
        from aisyn.split.centre.tenants import load_tenants

        tenants = load_tenants(args.tenants)
        log.info("serving %d tenant(s): %s", len(tenants), ", ".join(tenants.by_name))
    cfg = load_config(args.model)
    partition = parse_partition(args.cut, cfg)
    device, ranks = args.device, None
    if distributed.under_torchrun():
        procs.end_with_parent()  # a rank never outlives its torchrun agent
    if distributed.world_size() > 1:
        # torchrun: B's blocks as pipeline stages over the ranks (rank 0
        # alone listens); every wait between ranks is bounded by the idle
        # timeout, as the wait for the data party is.
        timeout = args.idle_timeout or COMPUTE_PARTY_IDLE_TIMEOUT_S
        ranks, device = Ranks.join(cfg, partition, resolve_device(device), timeout)
        ranks.check_shared(args.out, "compute party")
    # A pretrained folder (hf:DIR) is also where B's blocks start from.
    init_from = args.init_from or (args.model if hf_folder(args.model) else None)
    party = ComputeParty(
        cfg,
        partition,
        args.out,
        device=str(device),
        keep_checkpoints=args.keep_checkpoints,
        init_from=init_from,
        accept_unbound=args.accept_unbound_runs,
    )
    party.ranks = ranks
    party.batch_tenants = args.batch_tenants
    if ranks is not None and ranks.rank != 0:
        serve_ranks(party)
        return
    options = link_options(recv_timeout_s=args.idle_timeout)
    server = SplitServer(
        party,
        _settings(args, args.listen),
        options,
        args.hello_timeout,
        tenants=tenants,
        max_sessions=args.max_sessions,
        memory_bytes=math.inf if args.memory is None else args.memory,
        metrics_listen=args.metrics_listen,
        metrics_tls=metrics_tls,
    )
    server.start(args.address_file)
    stages = "" if ranks is None else f" (blocks over {ranks.world} ranks)"
    print(f"compute party listening on {server.address}{stages}", flush=True)
    try:
        server.serve_forever(args.exit_after)
    finally:
        server.stop()


# --- eval / merge -----------------------------------------------------------------


def cmd_eval(args) -> None:
    """Like `aisyn eval --run` on a split run, optionally against another compute
    party address than the one recorded."""

    from aisyn.eval.flags import eval_options
    from aisyn.eval.report import summary_lines
    from aisyn.split.client.evaluate import evaluate_split_run

    options = eval_options(args)
    peer = _settings(args, args.peer) if args.peer else None
    res = evaluate_split_run(args.run, peer=peer, **options)
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
    peer = _settings(args, args.peer) if args.peer else None

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


def _status_tls(args):
    """The TLS context of ``split status`` against an endpoint served with
    --metrics-tls-*: all three files, or none (plain HTTP)."""
    import ssl

    files = (args.tls_cert, args.tls_key, args.tls_ca)
    if not any(files):
        return None
    if not all(files):
        raise ValueError(
            "--tls-cert, --tls-key and --tls-ca go together: a client "
            "certificate and key the endpoint's --metrics-tls-ca signed, and the "
            "CA of its own certificate"
        )
    context = ssl.create_default_context(cafile=args.tls_ca)
    context.load_cert_chain(args.tls_cert, args.tls_key)
    return context


def cmd_status(args) -> None:
    """Each tenant's use of a running compute party, from its metrics
    endpoint (`aisyn split serve --metrics-listen HOST:PORT`): sessions open,
    steps, tokens, compute seconds, bytes each way, memory held, seconds
    queued and refusals."""
    import urllib.error
    import urllib.request

    from aisyn.split.centre.tenant_metrics import format_status, read_status

    context = _status_tls(args)
    url = f"{'https' if context else 'http'}://{args.metrics}/metrics"
    try:
        with urllib.request.urlopen(
            url, timeout=args.timeout, context=context
        ) as reply:
            text = reply.read(16 << 20).decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ConnectionError(f"cannot read {url}: {reason}") from None
    try:
        rows = read_status(text)
    except ValueError as e:
        raise ValueError(f"{url}: not a metrics page: {e}") from None
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
    elif rows:
        print(format_status(rows))
    else:
        print(f"no tenant has opened a session on {args.metrics} yet")


# --- parser -----------------------------------------------------------------------


def register(sub: argparse._SubParsersAction) -> None:
    ssub = add_group(
        sub,
        "split",
        "split (pipeline) training across two parties",
        description="Cross-domain split training: the data party A keeps the "
        "embedding and the head (tokens, labels and the loss never leave it), the "
        "compute party B runs the middle blocks. See docs/split.md.",
    )
    # A command's --help description is its cmd_* function's docstring.
    for add in (
        _add_plan,
        _add_train,
        _add_serve,
        _add_eval,
        _add_generate,
        _add_merge,
        _add_status,
    ):
        add(ssub)


def _add_plan(ssub: argparse._SubParsersAction) -> None:
    p = add_command(
        ssub,
        "plan",
        cmd_plan,
        "choose cut points from each party's throughput and memory",
    )
    add_flags(
        p,
        model_flag(REQUIRED, trains=False),
        (
            "--party",
            "append",
            REQUIRED,
            "NAME:THROUGHPUT:MEMORY, e.g. A:1:32GB and B:4:80GB (throughput in any "
            "unit, the same for both; memory like 80GB, 24GiB or inf); "
            "B:4:8x80GB: 8 devices of 80GB, B's blocks in 8 pipeline stages",
        ),
        ("--batch-size", positive_int, 8, "samples per optimizer step"),
        ("--micro-batch-size", positive_int, 1, "samples per forward/backward"),
        ("--seq-len", positive_int, None, "default: the model's (or the data's)"),
        (
            "--data",
            None,
            None,
            "prepared data: plan the model training on it builds (its "
            "tokenizer's vocabulary, its sequence length)",
        ),
        (
            "--dtype",
            ["fp32", "bf16", "fp16"],
            "bf16",
            "parameter and compute dtype (16-bit: with an fp32 master copy)",
        ),
        (
            "--autocast",
            ["off", "bf16"],
            "off",
            "bf16 autocast over fp32 parameters (needs --dtype fp32), as "
            "training's --autocast bf16",
        ),
        (
            "--activation-checkpointing",
            "store_true",
            None,
            "blocks keep only their input (as training's flag)",
        ),
        (
            "--schedule",
            list(SCHEDULES),
            "gpipe",
            "pipeline schedule over a party's devices (its activations in flight)",
        ),
        (
            "--runtime-memory",
            None,
            format_bytes(RUNTIME_BYTES).replace(" ", ""),
            "what each process holds before the model (CPU: torch + aisyn; add "
            "the CUDA context on a GPU)",
        ),
        ("--compress", list(CODECS), "none", "cut-layer codec"),
        (
            "--pipeline",
            nonneg_int,
            0,
            "micro-batches in flight beyond the first (0: lockstep)",
        ),
        (
            "--eod-reset",
            "store_true",
            None,
            "count the EOD-reset attention masks in the estimate",
        ),
        (
            "--shape",
            ["u", "two-way"],
            "u",
            "U-shape (A keeps embedding and head) or plain two-way cut",
        ),
        (
            "--min-a-blocks",
            nonneg_int,
            1,
            "blocks A keeps on each side of B (default 1; 0 lets the raw token "
            "embeddings cross, which B can invert to the tokens)",
        ),
        ("--cut", None, None, "report this cut instead of choosing"),
        ("--json", "store_true", None, "machine-readable output"),
    )


#: the cut both parties take when not told (the data party's default too)
DEFAULT_CUT = "u:1,1"


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
            "--init-from BASE, the loss on the answer tokens only (repeat)",
        ),
        ("--out", None, REQUIRED, "run folder"),
        ("--cut", None, DEFAULT_CUT, "u:FRONT,BACK blocks kept by A (see plan)"),
        ("--mode", ["local", "grpc"], "local", "local: both parties in this process"),
        ("--peer", validate.host_port, None, "compute party HOST:PORT (grpc)"),
        (
            "--spawn-backbone",
            "store_true",
            None,
            "start the compute party on this machine (grpc mode; ended at exit)",
        ),
        ("--pipeline", nonneg_int, 0, "micro-batches in flight (1F1B); 0: lockstep"),
        (
            "--compress",
            list(CODECS),
            "none",
            "cut-layer codec for activations and gradients",
        ),
        (
            "--connect-timeout",
            positive_float,
            DATA_PARTY_CONNECT_TIMEOUT_S,
            "seconds to keep trying while the compute party is unreachable or "
            "busy (queued, in order of arrival)",
        ),
    )
    t.add_argument(
        "--recv-timeout",
        type=_timeout,
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
        (
            "--backbone",
            list(BACKBONES),
            "train",
            "frozen: the compute party runs its blocks forward only, as the base "
            "has them, and no gradient crosses the cut (nothing A sends depends "
            "on its labels within a step); A trains its back blocks and head "
            "exactly (needs --init-from or --model hf:DIR; docs/privacy.md)",
        ),
        (
            "--front-via",
            list(FRONT_VIA),
            "emulator",
            "with --backbone frozen, how A's front learns: through a local "
            "emulator of B's blocks built from the public base (split/"
            "emulator.py), or not at all (frozen)",
        ),
        (
            "--emulator-blocks",
            nonneg_int,
            DEFAULT_EMULATOR_BLOCKS,
            "of B's blocks in A's emulator, uniformly spaced (0: pass the "
            "gradient straight through)",
        ),
        (
            "--private-warmup",
            nonneg_int,
            0,
            "train A's blocks and head alone on its own data for this many steps, "
            "through the emulator, before any activation leaves A: the front B "
            "then sees has drifted from the public base (needs --init-from)",
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
    _add_link_args(t, server=False)
    add_train_args(t)
    # A split run's seed is secret unless given (see split.client.train.secret_seed).
    t.set_defaults(seed=None)
    add_config_flag(t, "split-train")


def _add_serve(ssub: argparse._SubParsersAction) -> None:
    v = add_command(ssub, "serve", cmd_serve, "serve as the compute party over gRPC")
    add_flags(
        v,
        ("--listen", validate.listen_address, REQUIRED, "HOST:PORT (port 0: any free)"),
        model_flag(REQUIRED),
        ("--cut", None, DEFAULT_CUT, "u:FRONT,BACK (as the data party's)"),
        ("--out", None, None, "checkpoint root (none: cannot checkpoint)"),
        DEVICE,
        ("--keep-checkpoints", positive_int, 2, "checkpoints kept per run"),
        init_from_flag(
            "; it must hold the whole model: B loads only its tensors, and "
            "refuses a data party that starts from another base"
        ),
        ("--address-file", None, None, "write the bound HOST:PORT here once listening"),
        (
            "--max-sessions",
            positive_int,
            1,
            "sessions served at once, each on a thread of its own; more callers "
            "are told the server is busy and queued",
        ),
        (
            "--memory",
            _memory,
            None,
            "what the open sessions may hold at B in all, as the planner "
            "estimates each (e.g. 64GB); a session over it is refused with the "
            "numbers",
        ),
        (
            "--tenants",
            None,
            None,
            "TOML file of the data owners served (docs/split.md#tenants): each "
            "its own certificate and/or token, folder under --out and quotas",
        ),
        (
            "--batch-tenants",
            "store_true",
            None,
            "LoRA sessions over the shared --init-from base run the micro-batches "
            "that wait at once through it together, each row with its own "
            "adapters (one forward and backward for all)",
        ),
        (
            "--metrics-listen",
            validate.listen_address,
            None,
            "HOST:PORT of a Prometheus endpoint with each tenant's steps, "
            "tokens, compute seconds, bytes, sessions, memory, queue wait and "
            "refusals (plain HTTP unless --metrics-tls-*: keep it on loopback "
            "or an operators' network; `aisyn split status --metrics HOST:PORT` "
            "reads it)",
        ),
        (
            "--exit-after",
            positive_int,
            None,
            "exit after this many sessions (default: serve forever)",
        ),
        (
            "--accept-unbound-runs",
            "store_true",
            None,
            "let any data party continue a run bound to none over the network "
            "(made before runs were bound to their data party, or in-process by "
            "--mode local): for a compute party no one else can reach, as "
            "--spawn-backbone starts",
        ),
    )
    v.add_argument(
        "--idle-timeout",
        type=_timeout,
        default=COMPUTE_PARTY_IDLE_TIMEOUT_S,
        metavar="SECONDS",
        help="end a session whose data party, still connected, sends nothing for "
        "this long, e.g. between steps while it writes its checkpoints or "
        "evaluates, so it cannot hold the server (default %(default)g; 0 or none: "
        "wait forever)",
    )
    v.add_argument(
        "--hello-timeout",
        type=_timeout,
        default=COMPUTE_PARTY_HELLO_TIMEOUT_S,
        metavar="SECONDS",
        help="end a session whose data party sends no round this long after its "
        "hello, so that a silent one holds the server briefly while others queue "
        "(default %(default)g; raise it if the data party takes longer to load its "
        "checkpoint; 0 or none: the idle timeout)",
    )
    _add_link_args(v, server=True)
    add_tls_files(
        v.add_argument_group("metrics endpoint security"),
        cert="serve --metrics-listen over HTTPS with this certificate (PEM)",
        key="its private key (PEM)",
        ca="CA (PEM) that must have signed every scraper's client certificate "
        "(best one of its own: whatever it signed reads every tenant's use)",
        prefix="metrics-",
    )
    add_config_flag(v, "split-serve")


def _add_status(ssub: argparse._SubParsersAction) -> None:
    st = add_command(ssub, "status", cmd_status, "each tenant's use of a compute party")
    add_flags(
        st,
        (
            "--metrics",
            validate.listen_address,
            REQUIRED,
            "HOST:PORT of --metrics-listen",
        ),
        ("--timeout", positive_float, 10.0, "seconds to wait for the endpoint"),
        ("--json", "store_true", None, "print the figures as JSON"),
    )
    add_tls_files(
        st.add_argument_group("an endpoint served with --metrics-tls-*"),
        cert="client certificate (PEM) signed by the endpoint's --metrics-tls-ca",
        key="its private key (PEM)",
        ca="CA certificate (PEM) that signed the endpoint's",
    )


def _add_eval(ssub: argparse._SubParsersAction) -> None:
    e = add_command(ssub, "eval", cmd_eval, "evaluate a split run through the link")
    add_flags(
        e,
        ("--run", None, REQUIRED, "the data party's run folder"),
        ("--peer", validate.host_port, None, "override the compute party"),
    )
    add_eval_args(e)
    _add_link_args(e, server=False)


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
    _add_link_args(gen, server=False)


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
