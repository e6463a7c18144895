"""``aisyn privacy audit``: what the compute party of a split run recovers."""

from __future__ import annotations

from pathlib import Path

from aisyn.validate import nonneg_float, positive_int, seed


def cmd_audit(args) -> None:
    """Play the honest-but-curious compute party: for each --cut, compute what
    a split run of --base (or of --trained, fine-tuned from it) sends on rows
    of --data, then recover A's input tokens from the activations and its
    labels from the gradients (white-box with the base's weights or without,
    and learned on --public text: linear, in context, a sequence inverter,
    similarity to per-token references, and the known-plaintext bound, which
    also holds rows of --data's train split), beside the frequent-token
    baseline. Writes
    audit.md, audit.csv, audit.json and recovery.png to --out. --preset ci|full
    instead measures everything on the comparison's data and a base pretrained
    on public text only: each configuration of `aisyn split train` (noise,
    frozen backbone, private warm-up, combined) fine-tuned on A's text, by the
    share of fine-tuning's gain it keeps and what B's attacks still recover
    (frontier.md/.csv/.json/.png), then every cut undefended; it ends with the
    default's summary line, and refuses the flags that would choose other
    inputs or sizes."""

    from aisyn.privacy.audit import AuditSettings, audit

    if args.preset:
        from aisyn.privacy.presets import run_preset
        from aisyn.privacy.yardstick import summary_line

        # The preset brings its own base, data, cuts and sizes: a flag it would
        # silently ignore is refused instead.
        ignored = [f for f in PRESET_IGNORES if getattr(args, f) is not None]
        if ignored:
            raise ValueError(
                f"--preset {args.preset} measures on the comparison's own base, "
                "data and settings; drop "
                + ", ".join("--" + f.replace("_", "-") for f in ignored)
                + " (or --preset, to audit your own)"
            )

        report = run_preset(args.preset, args.out, seed=args.seed, resume=args.resume)
        print((Path(args.out) / "frontier.md").read_text())
        print(
            f"the undefended audit of every cut: {Path(args.out) / 'cuts' / 'audit.md'}"
        )
        print(f"done in {report['elapsed_s']:.0f} s")
        if report["default"] is None:
            print("default defence: not among the preset's configurations")
        else:  # the last line: scripts read it
            print(summary_line(report["default"]))
        return
    missing = [f for f in ("base", "data", "public") if getattr(args, f) is None]
    if missing:
        raise ValueError(
            "give --preset ci|full, or " + ", ".join(f"--{f}" for f in missing)
        )
    report = audit(
        args.base,
        args.data,
        args.public,
        args.out,
        args.cut or ["u:0,0", "u:1,1"],
        trained=args.trained,
        settings=AuditSettings(
            **{
                f: getattr(args, f)
                for f in ("samples", "public_samples", "steps")
                if getattr(args, f) is not None
            },
            seed=args.seed,
        ),
    )
    print((Path(args.out) / "audit.md").read_text())
    print(f"{len(report['rows'])} measurements in {report['elapsed_s']:.0f} s")


#: the flags of ``privacy audit`` that ``--preset`` replaces
PRESET_IGNORES = (
    "base",
    "data",
    "public",
    "cut",
    "trained",
    "samples",
    "public_samples",
    "steps",
)


def cmd_calibrate(args) -> None:
    """Clipping bounds for `aisyn split train --dp-*`, from public text: the
    median row norm of the returned gradients (and of the activations) when
    --base runs public rows at --cut in batches of --batch-size (the gradient
    scales with 1 / the tokens of a batch, so give the run's). Prints the
    flags of the recommended default (docs/privacy.md): noise multipliers
    --forward-noise on the activations and --backward-noise on the gradient
    (--forward-noise 0: the activations cross in the clear). The public text
    is --public's train split, or by default the built-in public corpus that
    `split train --defence recommended` calibrates on (so its flags are that
    run's). Public text keeps the bounds free of A's data, as the accounting
    assumes."""
    import torch

    from aisyn.data.shards import TokenShards
    from aisyn.data.tokenizer import open_tokenizer
    from aisyn.privacy.audit import draw
    from aisyn.split.defence.calibration import calibrate, public_rows, split_partition
    from aisyn.train.models import load_run_model
    from aisyn.train.run import TOKENIZER

    model, config = load_run_model(args.base)
    model.eval().requires_grad_(False)
    split_partition(args.cut, model)  # a cut split training refuses: before reading
    if args.public is None:
        tok = open_tokenizer(Path(args.base) / TOKENIZER, config["tokenizer"])
        seq_len = args.seq_len or config.get("seq_len") or model.config.seq_len
        # at least one batch, as split train --defence recommended takes
        rows = public_rows(tok, seq_len, max(args.samples, args.batch_size))
    else:
        public = TokenShards.open(
            args.public, "train", tokenizer_sha256=config["tokenizer"]["sha256"]
        )
        rows = draw(public, args.samples, torch.Generator().manual_seed(args.seed))
    clips = calibrate(model, rows, args.cut, args.batch_size)
    flags = [f"--cut {args.cut}"]
    for side, clip, noise in (
        ("forward", clips.forward, args.forward_noise),
        ("backward", clips.backward, args.backward_noise),
    ):
        if noise:
            # repr: the bound exactly, so the flags give the run that
            # --defence recommended would
            flags += [f"--dp-{side}-clip {clip!r}", f"--dp-{side}-noise {noise:g}"]
    print(" ".join(flags))


def register(sub) -> None:
    from aisyn.flagtable import REQUIRED, add_command, add_flags, add_group
    from aisyn.privacy.audit import AuditSettings
    from aisyn.split.defence.calibration import CALIBRATION_ROWS
    from aisyn.split.defence.cut_dp import RECOMMENDED

    psub = add_group(sub, "privacy", "measure what crosses in split training")
    a = add_command(psub, "audit", cmd_audit, "attack the cut as party B would")
    add_flags(
        a,
        (
            "--preset",
            ["ci", "full"],
            None,
            "measure everything on the comparison's inputs (instead of --base, "
            "--data, --public): ci in minutes, full a few hours on a 2-core CPU",
        ),
        ("--base", None, None, "the public base model (run folder) B knows"),
        ("--data", None, None, "A's private data (prepared shards; test split)"),
        ("--public", None, None, "public text of another domain (shards)"),
        ("--out", None, REQUIRED, "report folder (new)"),
        ("--cut", "append", None, "u:FRONT,BACK (repeat; default u:0,0 and u:1,1)"),
        ("--trained", None, None, "A's run fine-tuned from --base (late in training)"),
        (
            "--samples",
            positive_int,
            None,
            f"rows of A's data attacked (default {AuditSettings.samples})",
        ),
        (
            "--public-samples",
            positive_int,
            None,
            f"public rows B fits decoders on (default {AuditSettings.public_samples})",
        ),
        (
            "--steps",
            positive_int,
            None,
            f"optimisation steps per white-box attack (default {AuditSettings.steps})",
        ),
        ("--seed", seed, 0, "seed of the rows and attacks"),
        (
            "--resume",
            "store_true",
            False,
            "with --preset: go on in --out, reusing every run already trained "
            "and scored there (the attacks are run again on each)",
        ),
    )
    c = add_command(
        psub, "calibrate", cmd_calibrate, "clipping bounds for the cut's DP defence"
    )
    add_flags(
        c,
        (
            "--base",
            None,
            REQUIRED,
            "the base model (run folder) both parties start from",
        ),
        (
            "--public",
            None,
            None,
            "public text (prepared shards; train split); default: the built-in "
            "public corpus, as split train --defence recommended",
        ),
        ("--cut", None, "u:1,1", "the cut the run will use"),
        ("--batch-size", positive_int, 16, "the run's batch size"),
        (
            "--seq-len",
            positive_int,
            None,
            "without --public: the run's sequence length (default: the base's)",
        ),
        ("--samples", positive_int, CALIBRATION_ROWS, "public rows to measure"),
        (
            "--forward-noise",
            nonneg_float,
            RECOMMENDED.forward,
            "noise multiplier on the activations (0: none)",
        ),
        (
            "--backward-noise",
            nonneg_float,
            RECOMMENDED.backward,
            "noise multiplier on the returned gradient (0: none)",
        ),
        ("--seed", seed, 0, "seed of the rows measured"),
    )
