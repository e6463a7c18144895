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
from dataclasses import dataclass
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
from aisyn.split.client.options import base_of, check_options, check_resume
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
)
from aisyn.split.planner import exposure_warning
from aisyn.split.session import SPAWN_DIR, SplitOptions, open_session
from aisyn.train import checkpoint as ckpt
from aisyn.train.config import TrainConfig
from aisyn.train.device import autocast_on, resolve_device
from aisyn.train.engine import finished
from aisyn.train.job import open_engine
from aisyn.train.lora import Method
from aisyn.train.memory import check_fits, party_bytes, rank_bytes
from aisyn.train.models import BaseModel, check_base_tokenizer, model_config_for
from aisyn.train.objective import LMObjective, Objective, SFTObjective
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
    prepare-sft``) instead of token shards, the loss covers each item's
    supervised tokens (``train.objective.SFTObjective``), and a fresh run
    needs ``init_from``. The compute party cannot tell the difference: it gets
    the same rounds, with a sequence length that changes from step to step.
    """
    methods = (method or Method(), compute_method or Method())
    init_from = base_of(
        model_config, init_from, out, opts, methods, sft=sft, resume=resume
    )
    defence = check_options(opts, cfg, init_from, methods, defence, ranks, resume)
    objective = (SFTObjective if sft else LMObjective)(data_dirs, cfg)
    tok = objective.tokenizer
    mcfg = model_config_for(model_config, tok, objective.seq_len, data_dirs)
    if init_from is not None and str(init_from) != str(model_config):
        if sft or hf_folder(init_from) is not None:  # hf:DIR as --model: checked
            check_base_tokenizer(init_from, tok, data_dirs[0])
    partition = u_shape(opts.cut, mcfg)
    if opts.peer is not None:
        opts.peer.validate()
    device = resolve_device(cfg.device)
    check_memory(mcfg, partition, opts, cfg, objective.seq_len, device, ranks)
    base = open_base(init_from, mcfg, partition, DATA_PARTY) if init_from else None
    run = RunDir(out)
    old = run.read_config() if resume and (run.path / "config.json").is_file() else None
    defence = resolve_defence(
        defence, old, run, mcfg, opts, objective, cfg, init_from, device, ranks
    )
    config = split_config(
        old, mcfg, partition, cfg, opts, objective, data_dirs, base, methods, defence,
        ranks,
    )  # fmt: skip
    if old is not None:
        check_resume(run, old, config)
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
        started = _start(
            run, config, mcfg, partition, objective, cfg, opts, methods[0],
            methods[1], defence, base, device, ranks, a_steps, resume, sft, data_dirs,
        )  # fmt: skip
    except BaseException:
        before.restore()
        raise
    with started.session:
        return _train_loop(
            run, started, objective, cfg, opts, a_steps, base, progress, resume,
            tensorboard, ranks,
        )  # fmt: skip


def u_shape(cut: str, mcfg: ModelConfig):
    """The partition ``--cut`` names, refused unless labels and the loss stay
    with the data party (a U-shape); warned about when it exposes A's data."""
    partition = parse_partition(cut, mcfg)
    if not partition.is_u_shape:
        raise PartitionError(
            f"--cut {cut}: split training needs a U-shape cut (u:FRONT,BACK) "
            "so that labels and the loss stay with the data party"
        )
    if (warning := exposure_warning(partition)) is not None:
        log.warning("%s (docs/split.md#security)", warning)
    return partition


def check_memory(
    mcfg: ModelConfig,
    partition,
    opts: SplitOptions,
    cfg: TrainConfig,
    seq_len: int,
    device,
    ranks: DataRanks | None,
) -> None:
    """Refuse, in one line, a split run whose parties on this machine do not
    fit its memory: A (on its ranks), and B when started here (in-process or
    spawned) -- it shares this machine's memory."""
    on_this_machine = [DATA_PARTY] + (
        [COMPUTE_PARTY] if opts.mode == "local" or opts.spawn_backbone else []
    )
    sizing = dict(
        in_flight=opts.window + 1,
        autocast=autocast_on(device, cfg.autocast),
        activation_checkpointing=cfg.activation_checkpointing,
    )
    needed = sum(
        party_bytes(mcfg, partition, party, cfg.micro, seq_len, **sizing)
        for party in on_this_machine
        if party != DATA_PARTY or ranks is None
    )
    parties = list(on_this_machine)
    if ranks is not None:
        # A's ranks on this machine: they share its memory (CPU), or rank 0's
        # device holds rank 0's share
        per_rank = rank_bytes(
            mcfg, partition, DATA_PARTY, ranks.world, cfg.micro, seq_len,
            cfg.grad_accum, **sizing,
        )  # fmt: skip
        here = int(os.environ.get("LOCAL_WORLD_SIZE", ranks.world))
        needed += sum(per_rank[:here]) if device.type == "cpu" else per_rank[0]
        parties[0] = f"{DATA_PARTY} on {here} rank(s)"
    what = f"split training (party {' and '.join(parties)})"
    check_fits(needed, device, f"{what} with micro-batches of {cfg.micro}")


def resolve_defence(
    defence, old: dict | None, run: RunDir, mcfg, opts, objective, cfg, init_from,
    device, ranks,
) -> dp.CutDefence:  # fmt: skip
    """The cut defence the run trains with: the recommended one calibrated here
    on public text (or, resumed, as the run recorded it), or the flags' own."""
    if isinstance(defence, dp.Recommended):
        if old is not None:
            defence = recorded_defence(defence, run.path)
        else:
            defence = calibrated_defence(
                defence,
                mcfg,
                opts.cut,
                objective.tokenizer,
                objective.tokenizer_file,
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
    return defence


def split_config(
    old: dict | None, mcfg, partition, cfg, opts, objective, data_dirs, base,
    methods: tuple[Method, Method], defence: dp.CutDefence, ranks,
) -> dict:  # fmt: skip
    """A's ``config.json``: a resumed run keeps its ``run_id``."""
    run_id = (old or {}).get("run_id")
    if not isinstance(run_id, str):
        run_id = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(4)
    return {
        "kind": "split",
        "party": DATA_PARTY,
        "run_id": run_id,
        "model": mcfg.to_dict(),
        "partition": partition.to_dict(),
        "train": cfg.to_dict(),
        "split": opts.record(),
        "objective": objective.name,  # "sft": aisyn eval scores prompts
        "data": [str(Path(d).resolve()) for d in data_dirs],
        "tokenizer": objective.tokenizer,
        "seq_len": objective.seq_len,
        "init_from": str(base.checkpoint) if base else None,
        "method": methods[0].to_dict(),
        "compute_method": methods[1].to_dict(),
        # A's own file: the compute party is never told the defence.
        "cut_defence": defence.to_dict(),
        "world_size": 1 if ranks is None else ranks.world,  # its ranks (torchrun)
    }


@dataclass
class Started:
    """A's side of a split run, up: its state, the open session with B, the
    emulator of B's blocks (if any), the cut's guard."""

    state: PartyState
    opened: object
    session: contextlib.ExitStack
    guard: dp.CutGuard | None
    emulator: Emulator | None
    warmed: bool


def _start(
    run, config, mcfg, partition, objective, cfg, opts, method, compute_method,
    defence, base, device, ranks, a_steps, resume, sft, data_dirs,
) -> Started:  # fmt: skip
    """Build A's state, warm it up in private if asked, and open the session
    with B (whose hello tells it only what it needs to compute)."""
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
        run_id=config["run_id"],
        model=config["model"],
        partition=config["partition"],
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
    return Started(
        state,
        opened,
        session,
        # The noise follows from the run's seed, secret like it (whoever
        # knows it could subtract the noise, or rebuild A's init).
        dp.CutGuard(defence, cfg.seed, bottleneck) if defence.active else None,
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


def _train_loop(
    run: RunDir,
    started: Started,
    objective: Objective,
    cfg: TrainConfig,
    opts: SplitOptions,
    a_steps: list[int],
    base: BaseModel | None,
    progress: bool,
    resume: bool,
    tensorboard: bool,
    ranks: DataRanks | None,
) -> dict:
    state, opened, guard = started.state, started.opened, started.guard
    kw = dict(eod_id=objective.eod_id, window=opts.window, guard=guard)
    if ranks is None:
        session = DataSession(
            state,
            opened.link,
            **kw,
            frozen_backbone=opts.frozen,
            emulator=started.emulator,
        )
        executor = SplitExecutor(session, run.read_config()["run_id"], objective, base)
    else:
        session = RankedDataSession(state, opened.link, ranks, **kw)
        executor = RankedSplitExecutor(
            session, run.read_config()["run_id"], objective, base
        )
    # A's weights came from a private warm-up: a fresh start keeps them
    executor.warmed = started.warmed
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
    start_step = opened.reply["start_step"]
    if a_steps and start_step < a_steps[-1]:
        log.warning(
            "the compute party has no checkpoint of step %d; both resume from step %d",
            a_steps[-1],
            start_step,
        )
    folder = ckpt.step_folder(run.checkpoints, start_step) if start_step else None
    regime, engine, start_step = open_engine(
        run, objective, executor, cfg, folder,
        device=None,  # (started before the session opened)
        resume=resume, progress=progress, tensorboard=tensorboard,
        desc=f"split {objective.desc}",
    )  # fmt: skip
    if folder is None and base is not None:  # B did the same (the hello says so)
        log.info("initialised from %s", base.checkpoint)
    summary = engine.run(regime, range(start_step, cfg.steps))
    del summary["records"]
    summary.update(executor.summary(cfg.steps - start_step))
    if guard is not None:
        write_json_atomic(run.path / "privacy.json", summary["privacy"])
    return summary
