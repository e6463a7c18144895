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
import secrets
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aisyn.data.sft import IGNORE, SFTData, open_sft_many
from aisyn.data.shards import open_many
from aisyn.model.families import ModelConfig, hf_folder
from aisyn.model.plan import exposure_warning
from aisyn.model.segments import (
    COMPUTE_PARTY,
    DATA_PARTY,
    PartitionError,
    Segment,
    init_seeds,
    parse_partition,
)
from aisyn.split import protocol as proto
from aisyn.split.data_party import (
    DataSession,
    LossOf,
    MicroBatch,
    SplitModel,
    lm_loss_per_micro_batch,
)
from aisyn.split.defence import calibrated_defence, recorded_defence
from aisyn.split.party import (
    Base,
    PartyState,
    compute_lora_hello,
    open_base,
    place_weights,
    run_methods,
)
from aisyn.split.session import SPAWN_DIR, SplitOptions, open_session
from aisyn.train import checkpoint as ckpt
from aisyn.train import dp
from aisyn.train.engine import Engine, Regime, check_resume_target, finished_summary
from aisyn.train.finetune import SFTBatches, sft_eval_loss, supervised_loss_sum
from aisyn.train.loop import (
    TrainConfig,
    evaluate_loss,
    micro_batches,
    model_config_for,
    resolve_device,
)
from aisyn.train.lora import Method
from aisyn.train.memory import check_fits, compute_dtype, party_bytes
from aisyn.train.run import TOKENIZER, RunDir, write_json_atomic
from aisyn.train.sampler import BatchSampler

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
) -> dict:
    """Train as the data party; returns a summary like ``train.loop.train``.

    ``defence``: clipping and noise on what A sends (``train.dp``); its
    privacy budget is in each metrics record (``dp_epsilon``), the summary
    and the run's ``privacy.json``. B is not told. ``dp.Recommended()``: the
    recommended defence, calibrated here on public text (``split.defence``).

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
    only (``train.finetune``'s), and a fresh run needs ``init_from``. The
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
    if lora and resume and init_from is None and (Path(out) / "config.json").is_file():
        init_from = RunDir(out).read_config().get("init_from")  # LoRA's base
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
    if sft:
        source: StepSource = SFTSource(data_dirs, cfg)
    else:
        source = ShardSource(data_dirs, cfg)
    tok = source.tokenizer
    mcfg = model_config_for(model_config, tok, source.seq_len)
    if sft and init_from is not None:
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
    check_fits(
        sum(
            party_bytes(
                mcfg,
                partition,
                party,
                cfg.micro,
                source.seq_len,
                compute_dtype(device),
                in_flight=opts.window + 1,
            )
            for party in on_this_machine
        ),
        device,
        f"split training (party {' and '.join(on_this_machine)}) with "
        f"micro-batches of {cfg.micro}",
    )
    base = open_base(init_from, mcfg, partition, DATA_PARTY) if init_from else None
    run = RunDir(out)
    run_id = None
    if isinstance(defence, dp.Recommended):
        if sft:
            raise ValueError(
                "--defence recommended is calibrated for pre-training (--data); "
                "for --sft give the --dp-* flags (docs/privacy.md)"
            )
        if resume and (run.path / "config.json").is_file():
            defence = recorded_defence(defence, run.path)
        else:
            defence = calibrated_defence(
                defence,
                mcfg,
                opts.cut,
                tok,
                Path(data_dirs[0]) / tok["file"],
                source.seq_len,
                cfg,
                init_from,
                device,
            )
    defence = defence or dp.CutDefence()
    if resume and (run.path / "config.json").is_file():
        old = run.read_config()
        if old.get("kind") != "split":
            raise ValueError(f"{run.path}: not a split run; cannot --resume it here")
        was = old.get("objective", ShardSource.objective)
        if was != source.objective:
            flag = "--sft" if was == SFTSource.objective else "--data"
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
        "objective": source.objective,  # "sft": aisyn eval scores prompts
        "data": [str(Path(d).resolve()) for d in data_dirs],
        "tokenizer": tok,
        "seq_len": source.seq_len,
        "init_from": str(base.file) if base else None,
        "method": method.to_dict(),
        "compute_method": compute_method.to_dict(),
        # A's own file: the compute party is never told the defence.
        "cut_defence": defence.to_dict(),
    }
    a_steps = ckpt.complete_steps(run.checkpoints) if resume else []
    if a_steps:
        run.check_same_model(config)
        if not check_resume_target(a_steps[-1], cfg.steps, run):
            # Before the folder is rewritten or a session opened: nothing to train.
            state = ckpt.read_state(ckpt.step_folder(run.checkpoints, a_steps[-1]))
            done = finished_summary(run, state)
            return {**done, "bytes_sent_per_step": 0, "bytes_received_per_step": 0}
    # A start that fails or is refused leaves the folder as it found it, so
    # that the same command can be retried (not "already holds a run").
    before = FolderBefore.take(run.path)
    try:
        run.create(config, resume=resume)
        run.copy_tokenizer(Path(data_dirs[0]) / tok["file"])
        state = PartyState(mcfg, partition, DATA_PARTY, cfg, device, method=method)
        source.start(device)
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
        )
        b_init = base.file if base else None
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
            source,
            cfg,
            opts,
            a_steps,
            base,
            progress,
            tensorboard,
            # The noise follows from the run's seed, secret like it (whoever
            # knows it could subtract the noise, or rebuild A's init).
            dp.CutGuard(defence, cfg.seed) if defence.active else None,
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
    source: StepSource,
    cfg: TrainConfig,
    opts: SplitOptions,
    a_steps: list[int],
    base: Base | None,
    progress: bool,
    tensorboard: bool = False,
    guard: dp.CutGuard | None = None,
) -> dict:
    session = DataSession(
        state, opened.link, eod_id=source.eod_id, window=opts.window, guard=guard
    )
    regime = DataPartyTraining(run, session, source, cfg)
    engine = Engine.for_config(
        run,
        cfg,  # (the source validates exactly when cfg.eval_every is set)
        desc=f"split {source.desc}",
        progress=progress,
        tensorboard=tensorboard,
    )
    start_step = opened.reply["start_step"]
    folder = ckpt.step_folder(run.checkpoints, start_step) if start_step else None
    saved = place_weights(state, base, folder, fresh_train=True)
    if saved is not None:
        engine.load_state_dict(saved)
        regime.load_state_dict(saved)
        if a_steps and start_step < a_steps[-1]:
            log.warning(
                "the compute party has no checkpoint of step %d; both resume from "
                "step %d",
                a_steps[-1],
                start_step,
            )
        log.info("resumed from %s (step %d)", folder, start_step)
    elif base is not None:  # a fresh start; B did the same (the hello says so)
        log.info("initialised from %s", base.file)
    # From step 0 too: a killed attempt's rows must not stay ahead of the rerun's.
    run.truncate_metrics(start_step)
    summary = engine.run(regime, range(start_step, cfg.steps))
    steps_run = cfg.steps - start_step
    del summary["records"]
    summary["bytes_sent_per_step"] = regime.sent_total / steps_run if steps_run else 0
    summary["bytes_received_per_step"] = (
        regime.received_total / steps_run if steps_run else 0
    )
    if guard is not None:
        summary["privacy"] = regime.privacy()
        write_json_atomic(run.path / "privacy.json", summary["privacy"])
    return summary


class DataPartyTraining(Regime):
    """The data party's side of split training: each step is one TRAIN round
    with the compute party; checkpoints come in step-consistent pairs (B saves
    step N first, then A). What A trains on, and its loss, come from
    ``source`` (pre-training or fine-tuning); the step is the same."""

    def __init__(
        self,
        run: RunDir,
        session: DataSession,
        source: StepSource,
        cfg: TrainConfig,
    ) -> None:
        self.run, self.session, self.source, self.cfg = run, session, source, cfg
        self.state = session.state
        self.link = session.link
        self.run_id = run.read_config()["run_id"]
        self.tokens_per_step = 0  # the source's, set each step
        self.sent_total = self.received_total = 0
        self.validations = 0  # this session's: each sends every row it scores once
        self._eps: dict[int, float | None] = {}

    def train_step(self, step: int) -> dict:
        sent0, recv0 = self.link.bytes_sent, self.link.bytes_received
        ts = time.perf_counter()
        batch = self.source.next_step(self.cfg.batch_size)
        result = self.session.train_micro_batches(batch.micro, step, batch.loss_of)
        self.tokens_per_step = batch.tokens
        self.link.flush()
        sent = self.link.bytes_sent - sent0
        received = self.link.bytes_received - recv0
        self.sent_total += sent
        self.received_total += received
        record = {
            **result,
            **batch.record,
            "step_time_s": round(time.perf_counter() - ts, 4),
            "bytes_sent": sent,
            "bytes_received": received,
        }
        if self.session.guard is not None:
            record["dp_epsilon"] = self._epsilon(self.releases())
        return record

    def releases(self) -> int:
        """How many times a training row may have crossed so far (each epoch
        is a permutation: once per epoch it was drawn in)."""
        s = self.source.sampler
        return s.epoch + (1 if s.position else 0)

    def _epsilon(self, k: int) -> float | None:
        """ε of ``k`` releases (None: no finite bound); changes once an epoch."""
        if k not in self._eps:
            self._eps[k] = dp.finite_or_none(
                dp.epsilon(self.session.guard.defence, k, coordinates=self._coords())
            )
        return self._eps[k]

    def _coords(self) -> int:
        return self.source.seq_len * self.state.cfg.hidden_size

    def privacy(self) -> dict:
        """The run's privacy budget so far (``privacy.json``)."""
        defence = self.session.guard.defence
        k = self.releases()
        return {
            "defence": defence.to_dict(),
            "delta": defence.delta,
            "unit": "one training row (sequence), replaced",
            "releases_per_row": k,
            "dp_epsilon": self._epsilon(k),
            # validation rows cross forward only, once per validation
            "validations_this_session": self.validations,
            "dp_epsilon_validation_rows": dp.finite_or_none(
                dp.epsilon(
                    defence,
                    self.validations,
                    backward=False,
                    coordinates=self._coords(),
                )
            ),
        }

    def record_fields(self) -> dict:
        return self.source.record_fields()

    def log_line(self, done: int, total: int, record: dict) -> str:
        return (
            f"step {done}/{total} loss: {record['loss']:.6f} (sent "
            f"{record['bytes_sent']} B, received {record['bytes_received']} B)"
        )

    def validate(self) -> float | None:
        self.validations += 1
        return self.source.validate(SplitModel(self.session), self.cfg)

    def save(self, step: int, state: dict) -> None:
        self.session.save_remote(step)  # B's half first: pairs stay consistent
        ckpt.save(
            self.run.checkpoints,
            step,
            self.state.tensors(),
            {
                "party": DATA_PARTY,
                "run_id": self.run_id,
                **state,
                "model": self.state.cfg.to_dict(),
                "partition": self.state.partition.to_dict(),
                "train": self.cfg.to_dict(),
            },
            keep=self.cfg.keep_checkpoints,
        )

    def state_dict(self) -> dict:
        return {"sampler": self.source.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.source.sampler.load_state_dict(state["sampler"])


# --- what the data party trains on -------------------------------------------------


@dataclass
class StepBatch:
    """One optimizer step's worth of A's data, ready for the split step."""

    micro: list[MicroBatch]
    loss_of: LossOf  # the micro-batch loss, computed at A
    tokens: int  # input positions of the step (the ``tokens`` metric)
    record: dict = field(default_factory=dict)  # what the step's record adds


class StepSource:
    """Where a split run's batches and loss come from: the one thing that
    differs between split pre-training and split fine-tuning."""

    objective: str
    desc: str
    tokenizer: dict
    seq_len: int
    eod_id: int | None = None
    sampler: BatchSampler  # its state is the run's data position

    def start(self, device: torch.device) -> None:
        """Bind to the device (after the run folder exists)."""
        raise NotImplementedError

    def next_step(self, batch_size: int) -> StepBatch:
        raise NotImplementedError

    def record_fields(self) -> dict:
        raise NotImplementedError

    def validate(self, model: SplitModel, cfg: TrainConfig) -> float | None:
        raise NotImplementedError


class ShardSource(StepSource):
    """Pre-training on token shards (``aisyn prepare``): fixed windows of
    seq_len + 1 tokens, the loss over every next token, as ``aisyn train``."""

    objective = "lm"
    desc = "train"

    def __init__(self, data_dirs: Sequence[str | Path], cfg: TrainConfig) -> None:
        self.data_dirs, self.cfg = list(data_dirs), cfg
        self.sources = open_many(data_dirs, "train")
        self.tokenizer = self.sources[0].tokenizer_info
        self.seq_len = self.sources[0].seq_len
        self.eod_id = self.tokenizer["eod_id"] if cfg.eod_reset else None
        self.sampler = BatchSampler(self.sources, seed=cfg.seed)
        self.loss_of = lm_loss_per_micro_batch(cfg)

    def start(self, device: torch.device) -> None:
        self.device = device
        self.valid = (
            open_many(self.data_dirs[:1], "valid")[0] if self.cfg.eval_every else None
        )

    def next_step(self, batch_size: int) -> StepBatch:
        batch = self.sampler.next_batch(batch_size).to(self.device)
        micro = list(micro_batches(batch, self.cfg.micro, self.eod_id))
        return StepBatch(micro, self.loss_of, batch_size * self.seq_len)

    def record_fields(self) -> dict:
        return {"epoch": self.sampler.epoch}

    def validate(self, model: SplitModel, cfg: TrainConfig) -> float | None:
        return evaluate_loss(
            model,
            self.valid,
            batch_size=cfg.batch_size,
            max_batches=cfg.eval_batches,
            eod_id=self.eod_id,
            device=self.device,
        )


class SFTSource(StepSource):
    """Fine-tuning on supervised items (``aisyn prepare-sft``), as ``aisyn
    finetune`` does: the same batches (``SFTBatches``, right-padded to the
    batch's longest sequence) and the mean loss over the batch's answer tokens
    (``supervised_loss_sum``).

    Nothing of it crosses but the activations: B is not told the answer
    positions, the lengths or the loss. Right padding needs no mask at B --
    attention is causal, so a padded position never reaches an earlier one --
    and padded positions carry no target (``IGNORE``), so the loss skips them.
    """

    objective = "sft"
    desc = "finetune"

    def __init__(self, data_dirs: Sequence[str | Path], cfg: TrainConfig) -> None:
        if cfg.eod_reset:
            raise ValueError(
                "--eod-reset does not apply to --sft data (one item per sequence)"
            )
        self.data_dirs, self.cfg = list(data_dirs), cfg
        self.sources = open_sft_many(data_dirs, "train")
        self.tokenizer = self.sources[0].tokenizer_info
        self.seq_len = self.sources[0].seq_len

    def start(self, device: torch.device) -> None:
        self.batches = SFTBatches(self.sources, self.cfg.seed, device)
        self.sampler = self.batches.sampler
        self.valid = (
            SFTData.open(self.data_dirs[0], "valid") if self.cfg.eval_every else None
        )

    def next_step(self, batch_size: int) -> StepBatch:
        inputs, targets = self.batches.next(batch_size)
        answer_tokens = int((targets != IGNORE).sum())
        if answer_tokens == 0:
            raise ValueError("a batch without supervised tokens (corrupt SFT data?)")

        def loss_of(head: Segment, hidden: torch.Tensor, targets: torch.Tensor):
            # the batch's mean over answer tokens, as sft_step accumulates it
            return supervised_loss_sum(head.logits, hidden, targets)[0] / answer_tokens

        micro: list[MicroBatch] = [
            (mi, mt, None, None)
            for mi, mt in zip(
                inputs.split(self.cfg.micro), targets.split(self.cfg.micro), strict=True
            )
        ]
        return StepBatch(
            micro, loss_of, inputs.numel(), {"answer_tokens": answer_tokens}
        )

    def record_fields(self) -> dict:
        return {"epoch": round(self.batches.epoch_float, 4)}

    def validate(self, model: SplitModel, cfg: TrainConfig) -> float | None:
        if self.valid is None:
            return None
        return sft_eval_loss(
            model,
            self.valid,
            batch_size=cfg.batch_size,
            max_items=cfg.eval_batches * cfg.batch_size,
        )


def check_base_tokenizer(base: str | Path, tokenizer: dict, data_dir) -> None:
    """Refuse SFT data made with another tokenizer than the base model's.

    The base's tokenizer is in its run folder's config.json (a run folder, one
    of its checkpoint folders, or the model file in one); a bare .safetensors
    file has none, and then only the vocabulary size is checked (by the shape
    of the embedding, when the base is read).
    """
    file = ckpt.model_file(base)
    if not file.is_file():
        return  # reading the base says so, in one line
    run_configs = [Path(base) / "config.json"]
    if file.parent.parent.name == "checkpoints":  # run/checkpoints/step_N/
        run_configs.append(file.parent.parent.parent / "config.json")
    config = next((c for c in run_configs if c.is_file()), None)
    if config is None:
        log.warning(
            "%s: no run folder around the base model, so the tokenizer of %s cannot "
            "be checked against it (only the vocabulary size is)",
            base,
            data_dir,
        )
        return
    theirs = RunDir(config.parent).read_config().get("tokenizer", {}).get("sha256")
    if theirs is not None and theirs != tokenizer["sha256"]:
        raise ValueError(
            f"{data_dir}: prepared with tokenizer {tokenizer['sha256'][:12]}, but "
            f"the base model {base} uses {theirs[:12]}; re-run `aisyn prepare-sft "
            f"--tokenizer {config.parent / TOKENIZER}`"
        )
