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

import logging
import secrets
import time
from collections.abc import Sequence
from pathlib import Path

from aisyn.data.shards import open_many
from aisyn.model.pangu import PanguConfig, load_config
from aisyn.model.plan import exposure_warning
from aisyn.model.segments import (
    COMPUTE_PARTY,
    DATA_PARTY,
    PartitionError,
    init_seeds,
    parse_partition,
)
from aisyn.split import protocol as proto
from aisyn.split.data_party import DataSession, SplitModel
from aisyn.split.party import Base, PartyState, open_base
from aisyn.split.session import SplitOptions, open_session
from aisyn.train import checkpoint as ckpt
from aisyn.train.engine import Engine, Regime
from aisyn.train.loop import TrainConfig, evaluate_loss, resolve_device
from aisyn.train.memory import check_fits, compute_dtype, party_bytes
from aisyn.train.run import RunDir
from aisyn.train.sampler import BatchSampler

log = logging.getLogger("aisyn.split")


def model_config_for(model: PanguConfig | str | Path, tokenizer: dict) -> PanguConfig:
    """The model config, with the vocabulary of the data's tokenizer (as
    ``aisyn train`` does, so both runs build the same model)."""
    mcfg = load_config(model) if isinstance(model, str | Path) else model
    if mcfg.vocab_size != tokenizer["vocab_size"]:
        mcfg = PanguConfig(**{**mcfg.to_dict(), "vocab_size": tokenizer["vocab_size"]})
    return mcfg


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
    model_config: PanguConfig | str | Path,
    data_dirs: Sequence[str | Path],
    out: str | Path,
    cfg: TrainConfig,
    opts: SplitOptions,
    *,
    resume: bool = False,
    init_from: str | Path | None = None,
    progress: bool = True,
    tensorboard: bool = False,
) -> dict:
    """Train as the data party; returns a summary like ``train.loop.train``.

    ``init_from`` (run folder, checkpoint folder or .safetensors file): a run
    that starts at step 0 loads A's tensors from this base instead of the
    seeded init; the compute party must start from the same base (checked at
    the handshake), and one started here (local, spawned) is given it.
    """
    sources = open_many(data_dirs, "train")
    tok = sources[0].tokenizer_info
    mcfg = model_config_for(model_config, tok)
    if sources[0].seq_len > mcfg.seq_len:
        raise ValueError(
            f"data seq_len {sources[0].seq_len} exceeds the model's {mcfg.seq_len}"
        )
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
                sources[0].seq_len,
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
    if resume and (run.path / "config.json").is_file():
        old = run.read_config()
        if old.get("kind") != "split":
            raise ValueError(f"{run.path}: not a split run; cannot --resume it here")
        run_id = old["run_id"]
    run_id = run_id or time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(4)
    config = {
        "kind": "split",
        "party": DATA_PARTY,
        "run_id": run_id,
        "model": mcfg.to_dict(),
        "partition": partition.to_dict(),
        "train": cfg.to_dict(),
        "split": opts.record(),
        "data": [str(Path(d).resolve()) for d in data_dirs],
        "tokenizer": tok,
        "seq_len": sources[0].seq_len,
        "init_from": str(base.file) if base else None,
    }
    run.create(config, resume=resume)
    run.copy_tokenizer(sources[0].data_dir / tok["file"])

    state = PartyState(mcfg, partition, DATA_PARTY, cfg, device)
    sampler = BatchSampler(sources, seed=cfg.seed)
    eod_id = tok["eod_id"] if cfg.eod_reset else None
    valid = open_many(data_dirs[:1], "valid")[0] if cfg.eval_every else None
    a_steps = ckpt.complete_steps(run.checkpoints) if resume else []
    hello = proto.hello(
        purpose="train",
        run_id=run_id,
        model=mcfg.to_dict(),
        partition=partition.to_dict(),
        train=cfg,
        # B's own parameters' seeds, keyed by the run's seed: B learns nothing
        # from them about A's parameters, which it could otherwise rebuild
        # and invert the activations with.
        init_seeds=(
            None if base else init_seeds(mcfg, partition, COMPUTE_PARTY, cfg.seed)
        ),
        resume=resume,
        a_steps=a_steps,
        codec=opts.codec,
        init=base.fingerprint if base else None,
    )
    b_init = base.file if base else None
    with open_session(run, mcfg, partition, hello, opts, cfg.device, b_init) as opened:
        return _train_loop(
            run,
            opened,
            state,
            sampler,
            valid,
            eod_id,
            cfg,
            opts,
            a_steps,
            base,
            progress,
            tensorboard,
        )


def _train_loop(
    run: RunDir,
    opened,
    state: PartyState,
    sampler: BatchSampler,
    valid,
    eod_id: int | None,
    cfg: TrainConfig,
    opts: SplitOptions,
    a_steps: list[int],
    base: Base | None,
    progress: bool,
    tensorboard: bool = False,
) -> dict:
    session = DataSession(state, opened.link, eod_id=eod_id, window=opts.window)
    regime = DataPartyTraining(run, session, sampler, valid, eod_id, cfg)
    engine = Engine.for_config(
        run,
        cfg,  # (valid is None exactly when cfg.eval_every is 0)
        desc="split train",
        progress=progress,
        tensorboard=tensorboard,
    )
    start_step = opened.reply["start_step"]
    if start_step:
        folder = ckpt.step_folder(run.checkpoints, start_step)
        saved = state.load(folder)
        engine.load_state_dict(saved)
        regime.load_state_dict(saved)
        run.truncate_metrics(start_step)
        if a_steps and start_step < a_steps[-1]:
            log.warning(
                "the compute party has no checkpoint of step %d; both resume from "
                "step %d",
                a_steps[-1],
                start_step,
            )
        log.info("resumed from %s (step %d)", folder, start_step)
    elif base is not None:  # a fresh start; B did the same (the hello says so)
        state.init_from(base)
        log.info("initialised from %s", base.file)
    summary = engine.run(regime, range(start_step, cfg.steps))
    steps_run = cfg.steps - start_step
    del summary["records"]
    summary["bytes_sent_per_step"] = regime.sent_total / steps_run if steps_run else 0
    summary["bytes_received_per_step"] = (
        regime.received_total / steps_run if steps_run else 0
    )
    return summary


class DataPartyTraining(Regime):
    """The data party's side of split training: each step is one TRAIN round
    with the compute party; checkpoints come in step-consistent pairs (B saves
    step N first, then A)."""

    def __init__(
        self,
        run: RunDir,
        session: DataSession,
        sampler: BatchSampler,
        valid,
        eod_id: int | None,
        cfg: TrainConfig,
    ) -> None:
        self.run, self.session, self.sampler = run, session, sampler
        self.valid, self.eod_id, self.cfg = valid, eod_id, cfg
        self.state = session.state
        self.link = session.link
        self.run_id = run.read_config()["run_id"]
        self.tokens_per_step = cfg.batch_size * sampler.sources[0].seq_len
        self.sent_total = self.received_total = 0

    def train_step(self, step: int) -> dict:
        sent0, recv0 = self.link.bytes_sent, self.link.bytes_received
        ts = time.perf_counter()
        batch = self.sampler.next_batch(self.cfg.batch_size).to(self.state.device)
        result = self.session.train_step(batch, step)
        self.link.flush()
        sent = self.link.bytes_sent - sent0
        received = self.link.bytes_received - recv0
        self.sent_total += sent
        self.received_total += received
        return {
            **result,
            "step_time_s": round(time.perf_counter() - ts, 4),
            "bytes_sent": sent,
            "bytes_received": received,
        }

    def record_fields(self) -> dict:
        return {"epoch": self.sampler.epoch}

    def log_line(self, done: int, total: int, record: dict) -> str:
        return (
            f"step {done}/{total} loss: {record['loss']:.6f} (sent "
            f"{record['bytes_sent']} B, received {record['bytes_received']} B)"
        )

    def validate(self) -> float | None:
        return evaluate_loss(
            SplitModel(self.session),
            self.valid,
            batch_size=self.cfg.batch_size,
            max_batches=self.cfg.eval_batches,
            eod_id=self.eod_id,
            device=self.state.device,
        )

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
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
