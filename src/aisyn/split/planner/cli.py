"""``aisyn split plan``: where to cut, per party: shares, peak memory, time."""

from __future__ import annotations

import argparse
import json
import logging

from aisyn.flagtable import (
    REQUIRED,
    add_command,
    add_flags,
    model_flag,
)
from aisyn.link.codec import CODECS
from aisyn.model.cost import RUNTIME_BYTES, format_bytes
from aisyn.model.memory import SCHEDULES
from aisyn.validate import (
    nonneg_int,
    positive_int,
)

log = logging.getLogger("aisyn.split")


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


def register(ssub: argparse._SubParsersAction) -> None:
    """Add ``plan`` to ``aisyn split``."""
    for add in (_add_plan,):
        add(ssub)
