"""``aisyn split train``: the data party's training loop.

The same run folder as ``aisyn train`` (config.json with ``"kind": "split"``,
metrics.jsonl, loss.png, checkpoints/, tokenizer.model), holding only A's
half of the model; each metrics record adds the link bytes sent and received
in that step. Checkpoints come in step-consistent pairs: A asks B to save
step N, waits until B's copy is on disk, then writes its own; both keep the
last few, so after a crash of either side (even mid-save) the newest step
both have exists, and ``--resume`` continues from it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from aisyn.model.families import ModelConfig, hf_folder
from aisyn.model.segments import (
    COMPUTE_PARTY,
    DATA_PARTY,
    PartitionError,
    init_seeds,
    parse_partition,
)
from aisyn.split import protocol as proto
from aisyn.split.client.data_party import DataSession
from aisyn.split.client.data_ranks import (
    DataRanks,
    RankedDataSession,
    RankedSplitExecutor,
    start_words,
)
from aisyn.split.client.executor import SplitExecutor
from aisyn.split.defence import cut_dp as dp
from aisyn.split.defence.attach import (
    attach_bottleneck,
    calibrate_bottleneck,
    calibrated_defence,
    recorded_defence,
)
from aisyn.split.defence.emulator import Emulator
from aisyn.split.defence.warmup import private_warmup
from aisyn.split.party import (
    PartyState,
    compute_lora_hello,
    open_base,
    place_weights,
    run_methods,
)
from aisyn.split.planner import exposure_warning
from aisyn.split.session import SPAWN_DIR, SplitOptions, open_session
from aisyn.train import checkpoint as ckpt
from aisyn.train.config import TrainConfig
from aisyn.train.device import autocast_on, resolve_device
from aisyn.train.engine import Engine, finished
from aisyn.train.lora import Method
from aisyn.train.memory import check_fits, party_bytes, rank_bytes
from aisyn.train.models import BaseModel, check_base_tokenizer, model_config_for
from aisyn.train.objective import LMObjective, Objective, SFTObjective
from aisyn.train.regime import Regime
from aisyn.train.run import RunDir, write_json_atomic

log = logging.getLogger("aisyn.split")


def secret_seed(out: str | Path, resume: bool) -> int:
    """The seed of a split run whose user gave none: the run's own when
    resuming it, else a fresh random 63-bit one (recorded in A's config.json).

    A's initial weights follow from the seed; a guessable one (the usual
    1234) would let the compute party rebuild them and invert the
    activations it receives, so a split run's seed is a secret by default.
    """
    config = Path(out) / "config.json"
    if resume and config.is_file():
        seed = RunDir(out).read_config().get("train", {}).get("seed")
        if isinstance(seed, int):
            return seed
    return secrets.randbits(63)


def split_train(
    model_config: ModelConfig | str | Path,
    data_dirs: Sequence[str | Path],
    out: str | Path,
    cfg: TrainConfig,
    opts: SplitOptions,
    *,
    sft: bool = False,
    resume: bool = False,
    init_from: str | Path | None = None,
    progress: bool = True,
    tensorboard: bool = False,
    method: Method | None = None,
    compute_method: Method | None = None,
    defence: dp.CutDefence | dp.Recommended | None = None,
    ranks: DataRanks | None = None,
) -> dict:
    """Train as the data party; returns a summary like ``train.pretrain.train``.

    ``ranks``: this is rank 0 of a data party over a torchrun job
    (``split.client.data_ranks``), the other ranks following it.

    ``defence``: clipping and noise on what A sends (``split.defence.cut_dp``); its
    privacy budget is in each metrics record (``dp_epsilon``), the summary
    and the run's ``privacy.json``. B is not told. ``dp.Recommended()``: the
    recommended defence, calibrated here on public text (``split.defence.attach``).

    ``method`` / ``compute_method``: full training or LoRA of the data party's
    / the compute party's blocks (default: full for both). A LoRA party keeps
    its base weights frozen and trains adapters only (its checkpoints hold
    just those); it needs ``init_from``.

    ``init_from`` (run folder, checkpoint folder or .safetensors file): a run
    that starts at step 0 loads A's tensors from this base instead of the
    seeded init; the compute party must start from the same base (checked at
    the handshake), and one started here (local, spawned) is given it.

    ``sft``: split fine-tuning. ``data_dirs`` are SFT folders (``aisyn
    prepare-sft``) instead of token shards, the loss covers the answer tokens
    only (``train.objective.SFTObjective``), and a fresh run needs ``init_from``. The
    compute party cannot tell the difference: it gets the same rounds, with a
    sequence length that changes from step to step.
    """
    if init_from is None and isinstance(model_config, str | Path):
        if hf_folder(model_config) is not None:
            init_from = model_config  # a pretrained folder brings its weights
    if init_from is not None and not (hf_folder(init_from) or Path(init_from)).exists():
        raise ValueError(
            f"--init-from {init_from}: no such base model (a run folder, "
            "checkpoint folder or .safetensors file)"
        )
    check_pipeline(opts.window, cfg)
    method, compute_method = method or Method(), compute_method or Method()
    lora = method.name == "lora" or compute_method.name == "lora"
    recorded = resume and (Path(out) / "config.json").is_file()
    needs_base = lora or opts.frozen or opts.private_warmup
    if needs_base and recorded and init_from is None:
        # LoRA's base, or the frozen backbone's (A's emulator reads it)
        init_from = RunDir(out).read_config().get("init_from")
    if lora and init_from is None:
        raise ValueError(
            "LoRA trains adapters on a base model: give --init-from BASE (or "
            "--model hf:DIR); the compute party needs the same base"
        )
    if sft and init_from is None and not resume:
        raise ValueError(
            "--sft: split fine-tuning starts from a pre-trained base; give "
            "--init-from BASE (the compute party starts from the same base)"
        )
    if ranks is not None and (why := ranks.problem_with(cfg.micro, method)):
        raise ValueError(why)
    if opts.frozen and isinstance(defence, dp.Recommended):
        defence = replace(defence, gradient=False)  # no gradient to noise
    if opts.frozen:
        check_frozen_backbone(opts, init_from, compute_method, defence, ranks, resume)
    if opts.private_warmup:
        check_warmup(opts, init_from, method, ranks, resume)
    objective = (SFTObjective if sft else LMObjective)(data_dirs, cfg)
    tok = objective.tokenizer
    mcfg = model_config_for(model_config, tok, objective.seq_len, data_dirs)
    if init_from is not None and str(init_from) != str(model_config):
        if sft or hf_folder(init_from) is not None:  # hf:DIR as --model: checked
            check_base_tokenizer(init_from, tok, data_dirs[0])
    partition = parse_partition(opts.cut, mcfg)
    if not partition.is_u_shape:
        raise PartitionError(
            f"--cut {opts.cut}: split training needs a U-shape cut (u:FRONT,BACK) "
            "so that labels and the loss stay with the data party"
        )
    if (warning := exposure_warning(partition)) is not None:
        log.warning("%s (docs/split.md#security)", warning)
    if opts.peer is not None:
        opts.peer.validate()
    device = resolve_device(cfg.device)
    # A compute party started here (in-process or spawned) shares this memory.
    on_this_machine = [DATA_PARTY] + (
        [COMPUTE_PARTY] if opts.mode == "local" or opts.spawn_backbone else []
    )
    sizing = dict(
        in_flight=opts.window + 1,
        autocast=autocast_on(device, cfg.autocast),
        activation_checkpointing=cfg.activation_checkpointing,
    )
    needed = sum(
        party_bytes(mcfg, partition, party, cfg.micro, objective.seq_len, **sizing)
        for party in on_this_machine
        if party != DATA_PARTY or ranks is None
    )
    parties = list(on_this_machine)
    if ranks is not None:
        # A's ranks on this machine: they share its memory (CPU), or rank 0's
        # device holds rank 0's share
        per_rank = rank_bytes(
            mcfg, partition, DATA_PARTY, ranks.world, cfg.micro, objective.seq_len,
            cfg.grad_accum, **sizing,
        )  # fmt: skip
        here = int(os.environ.get("LOCAL_WORLD_SIZE", ranks.world))
        needed += sum(per_rank[:here]) if device.type == "cpu" else per_rank[0]
        parties[0] = f"{DATA_PARTY} on {here} rank(s)"
    what = f"split training (party {' and '.join(parties)})"
    check_fits(needed, device, f"{what} with micro-batches of {cfg.micro}")
    base = open_base(init_from, mcfg, partition, DATA_PARTY) if init_from else None
    run = RunDir(out)
    run_id = None
    if isinstance(defence, dp.Recommended):
        if resume and (run.path / "config.json").is_file():
            defence = recorded_defence(defence, run.path)
        else:
            defence = calibrated_defence(
                defence,
                mcfg,
                opts.cut,
                tok,
                Path(data_dirs[0]) / tok["file"],
                objective.seq_len,
                cfg,
                init_from,
                device,
            )
    defence = defence or dp.CutDefence()
    if defence.bottleneck is not None and ranks is not None:
        raise ValueError(
            "--bottleneck-floor: a trained bottleneck runs with a data party of "
            "one process (this one runs over ranks)"
        )
    if resume and (run.path / "config.json").is_file():
        old = run.read_config()
        if old.get("kind") != "split":
            raise ValueError(f"{run.path}: not a split run; cannot --resume it here")
        was = old.get("objective", LMObjective.name)
        if was != objective.name:
            flag = "--sft" if was == SFTObjective.name else "--data"
            raise ValueError(
                f"{run.path}: a split run of objective {was!r}; resume it with {flag}"
            )
        run_id = old["run_id"]
        was_defence = dp.CutDefence.from_dict(old.get("cut_defence"))
        if was_defence != defence:
            raise ValueError(
                f"{run.path}: trained with cut defence {was_defence.describe()}; "
                "resume it with the same defence flags (its privacy budget "
                "is accounted over the whole run)"
            )
        was_split = old.get("split", {})
        for key, flag in FROZEN_FLAGS.items():
            was = was_split.get(key, SplitOptions.__dataclass_fields__[key].default)
            if was != getattr(opts, key):
                raise ValueError(
                    f"{run.path}: trained with {flag} {was}; resume it with that"
                )
        if run_methods(old) != (method, compute_method):
            raise ValueError(
                f"{run.path}: trained with method {run_methods(old)[0].name} / "
                f"compute method {run_methods(old)[1].name}; resume it with those"
            )
    run_id = run_id or time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(4)
    config = {
        "kind": "split",
        "party": DATA_PARTY,
        "run_id": run_id,
        "model": mcfg.to_dict(),
        "partition": partition.to_dict(),
        "train": cfg.to_dict(),
        "split": opts.record(),
        "objective": objective.name,  # "sft": aisyn eval scores prompts
        "data": [str(Path(d).resolve()) for d in data_dirs],
        "tokenizer": tok,
        "seq_len": objective.seq_len,
        "init_from": str(base.checkpoint) if base else None,
        "method": method.to_dict(),
        "compute_method": compute_method.to_dict(),
        # A's own file: the compute party is never told the defence.
        "cut_defence": defence.to_dict(),
        "world_size": 1 if ranks is None else ranks.world,  # its ranks (torchrun)
    }
    a_steps = ckpt.complete_steps(run.checkpoints) if resume else []
    if a_steps:
        run.check_same_model(config)
        last = ckpt.step_folder(run.checkpoints, a_steps[-1])
        # Before the folder is rewritten or a session opened: nothing to train.
        if (done := finished(run, last, cfg.steps)) is not None:
            return {**done, "bytes_sent_per_step": 0, "bytes_received_per_step": 0}
    # A start that fails or is refused leaves the folder as it found it, so
    # that the same command can be retried (not "already holds a run").
    before = FolderBefore.take(run.path)
    try:
        run.start(config, resume=resume, tokenizer=objective.tokenizer_file)
        state = PartyState(mcfg, partition, DATA_PARTY, cfg, device, method=method)
        bottleneck = attach_bottleneck(state, defence)  # None without one
        if ranks is not None:
            start_words(
                ranks,
                state,
                eod_id=objective.eod_id,
                window=opts.window,
                defence=defence,
                init_from=str(base.checkpoint) if base else None,
            )
        objective.start(device)
        emulator = None
        if (opts.frozen and opts.front_via == "emulator") or opts.private_warmup:
            assert base is not None  # check_frozen_backbone, check_warmup
            emulator = Emulator.from_base(
                str(base.checkpoint), mcfg, partition, opts.emulator_blocks, device
            )
            log.info(
                "an emulator of B's blocks %s stands in for them at this party "
                "(split/defence/emulator.py)",
                emulator.indices,
            )
        warmed = opts.private_warmup > 0 and not a_steps
        if warmed:
            # Before B is even dialled: the front it will see has drifted.
            place_weights(state, base, None, fresh_train=True)
            record = private_warmup(
                state,
                emulator,
                lambda c: (SFTObjective if sft else LMObjective)(data_dirs, c),
                opts.private_warmup,
            )
            write_json_atomic(run.path / "warmup.json", record)
        hello = proto.hello(
            purpose="train",
            run_id=run_id,
            model=mcfg.to_dict(),
            partition=partition.to_dict(),
            train=cfg,
            # B's own parameters' seeds, keyed by the run's seed: B learns
            # nothing from them about A's parameters, which it could otherwise
            # rebuild and invert the activations with.
            init_seeds=(
                None if base else init_seeds(mcfg, partition, COMPUTE_PARTY, cfg.seed)
            ),
            lora=compute_lora_hello(mcfg, partition, compute_method, cfg.seed),
            resume=resume,
            a_steps=a_steps,
            codec=opts.codec,
            init=base.fingerprint if base else None,
            backbone=opts.backbone,
        )
        b_init = base.checkpoint if base else None
        session = contextlib.ExitStack()
        opened = session.enter_context(
            open_session(run, mcfg, partition, hello, opts, cfg.device, b_init)
        )
    except BaseException:
        before.restore()
        raise
    with session:
        return _train_loop(
            run,
            opened,
            state,
            objective,
            cfg,
            opts,
            a_steps,
            base,
            progress,
            resume,
            tensorboard,
            # The noise follows from the run's seed, secret like it (whoever
            # knows it could subtract the noise, or rebuild A's init).
            dp.CutGuard(defence, cfg.seed, bottleneck) if defence.active else None,
            ranks,
            emulator if opts.frozen and opts.front_via == "emulator" else None,
            warmed,
        )


@dataclass
class FolderBefore:
    """What a run folder held before a start wrote to it, to put it back if
    the start fails: what the start added goes (a spawned compute party's log
    stays, as the error names it), and a resumed run's config.json is put
    back as it was."""

    path: Path
    existed: bool
    names: frozenset[str]
    config: bytes | None

    @classmethod
    def take(cls, path: Path) -> FolderBefore:
        if not path.is_dir():
            return cls(path, False, frozenset(), None)
        config = path / "config.json"
        return cls(
            path,
            True,
            frozenset(p.name for p in path.iterdir()),
            config.read_bytes() if config.is_file() else None,
        )

    def restore(self) -> None:
        if not self.path.is_dir():
            return
        log_file = self.path / SPAWN_DIR / "server.log"
        keep = log_file.read_bytes() if log_file.is_file() else None
        for child in self.path.iterdir():
            if child.name in self.names:
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
        if self.config is not None:
            write_bytes_atomic(self.path / "config.json", self.config)
        if keep is not None:
            log_file.parent.mkdir(exist_ok=True)
            log_file.write_bytes(keep)
            log.info("the spawned compute party's log is kept: %s", log_file)
        elif not self.existed and not any(self.path.iterdir()):
            self.path.rmdir()


def write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


#: the options of a frozen backbone a resumed run must keep (key -> flag)
FROZEN_FLAGS = {
    "backbone": "--backbone",
    "front_via": "--front-via",
    "emulator_blocks": "--emulator-blocks",
}


def check_frozen_backbone(
    opts: SplitOptions,
    init_from: str | Path | None,
    compute_method: Method,
    defence: object,
    ranks: DataRanks | None,
    resume: bool,
) -> None:
    """Refuse, in one line, what cannot go with ``--backbone frozen``."""
    if init_from is None and not resume:
        raise ValueError(
            "--backbone frozen runs the compute party's blocks as a base model has "
            "them: give --init-from BASE (or --model hf:DIR); both parties start "
            "from it"
        )
    if compute_method.name == "lora":
        raise ValueError(
            "--backbone frozen: the compute party trains nothing, so "
            "--compute-method lora has nothing to adapt; leave it out"
        )
    if isinstance(defence, dp.CutDefence) and defence.backward is not None:
        raise ValueError(
            "--backbone frozen: no gradient crosses the cut, so there is none to "
            "clip or noise; leave out --dp-backward-* (--dp-forward-* and "
            "--defence recommended, its noise on the activations alone, apply)"
        )
    if ranks is not None:
        raise ValueError(
            "--backbone frozen runs with a data party of one process (this one "
            "runs over ranks)"
        )


def check_warmup(
    opts: SplitOptions,
    init_from: str | Path | None,
    method: Method,
    ranks: DataRanks | None,
    resume: bool,
) -> None:
    """Refuse, in one line, what cannot go with ``--private-warmup``."""
    if init_from is None and not resume:
        raise ValueError(
            "--private-warmup trains through an emulator of B's blocks built from "
            "the public base: give --init-from BASE (or --model hf:DIR)"
        )
    if method.name == "lora":
        raise ValueError(
            "--private-warmup trains this party's blocks themselves; with "
            "--method lora leave it out"
        )
    if ranks is not None:
        raise ValueError(
            "--private-warmup runs on a data party of one process (this one runs "
            "over ranks)"
        )


def check_pipeline(window: int, cfg: TrainConfig) -> None:
    """Refuse ``--pipeline`` where a step has one micro-batch: there would be
    nothing to overlap, and the run would silently be lockstep."""
    if not window or cfg.grad_accum >= 2:
        return
    b = cfg.batch_size
    fix = (
        f"set --micro-batch-size to a divisor of {b} below it, e.g. "
        f"{max(d for d in range(1, b) if b % d == 0)}"
        if b >= 2
        else "set --batch-size to 2 or more and --micro-batch-size below it"
    )
    raise ValueError(
        f"--pipeline {window} overlaps the micro-batches of a step, and a step of "
        f"--batch-size {b} with --micro-batch-size {cfg.micro} has only one: "
        f"{fix} (or leave out --pipeline)"
    )


def _train_loop(
    run: RunDir,
    opened,
    state: PartyState,
    objective: Objective,
    cfg: TrainConfig,
    opts: SplitOptions,
    a_steps: list[int],
    base: BaseModel | None,
    progress: bool,
    resume: bool,
    tensorboard: bool = False,
    guard: dp.CutGuard | None = None,
    ranks: DataRanks | None = None,
    emulator: Emulator | None = None,
    warmed: bool = False,
) -> dict:
    kw = dict(eod_id=objective.eod_id, window=opts.window, guard=guard)
    if ranks is None:
        session = DataSession(
            state,
            opened.link,
            **kw,
            frozen_backbone=opts.frozen,
            emulator=emulator,
        )
        executor = SplitExecutor(session, run.read_config()["run_id"], objective, base)
    else:
        session = RankedDataSession(state, opened.link, ranks, **kw)
        executor = RankedSplitExecutor(
            session, run.read_config()["run_id"], objective, base
        )
    # A's weights came from a private warm-up: a fresh start keeps them
    executor.warmed = warmed
    if guard is not None and guard.bottleneck is not None:
        # a fresh start calibrates it through A's front as it starts; a
        # resumed one loads it with A's checkpoint
        executor.fresh_start = lambda: calibrate_bottleneck(
            guard.bottleneck,
            state,
            objective.tokenizer,
            objective.tokenizer_file,
            objective.seq_len,
        )
    regime = Regime(objective, executor, cfg, run)
    engine = Engine.for_config(
        run,
        cfg,  # (the objective validates exactly when cfg.eval_every is set)
        desc=f"split {objective.desc}",
        progress=progress,
        tensorboard=tensorboard,
    )
    start_step = opened.reply["start_step"]
    if a_steps and start_step < a_steps[-1]:
        log.warning(
            "the compute party has no checkpoint of step %d; both resume from step %d",
            a_steps[-1],
            start_step,
        )
    folder = ckpt.step_folder(run.checkpoints, start_step) if start_step else None
    start_step = engine.restore(regime, folder, resume=resume)
    if folder is None and base is not None:  # B did the same (the hello says so)
        log.info("initialised from %s", base.checkpoint)
    summary = engine.run(regime, range(start_step, cfg.steps))
    del summary["records"]
    summary.update(executor.summary(cfg.steps - start_step))
    if guard is not None:
        write_json_atomic(run.path / "privacy.json", summary["privacy"])
    return summary
