"""What a federated client does, as plain functions (the Flower handlers in
``client_app.py`` only unpack messages and call these).

One fresh process per message: load the base model (meta-init, then the
weights; no random init, no re-tokenising: SFT data are pre-tokenised
tensors), check that its base and data match what the server announced, load
the global trainable tensors, report their validation loss, train E local
steps continuing the run's schedule and data order (with ``--local-optimizer
kept``, its own AdamW moments too: ``fl.round_files``), save its local model,
and return only the trainable tensors.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from torch import nn

from aisyn.data.sft import SFTData
from aisyn.fl import chunks
from aisyn.fl.node import build_trainable, start_run
from aisyn.fl.records import (
    CONTROL,
    payload_bytes,
    record_to_tensors,
    tensors_to_record,
)
from aisyn.fl.round_files import RoundFiles
from aisyn.fl.round_message import (
    setting_differences,
    settings_from_record,
)
from aisyn.fl.scaffold import (
    ControlCorrection,
    load_client_control,
    save_client_control,
)
from aisyn.fl.settings import FLSettings
from aisyn.train import checkpoint as ckpt
from aisyn.train.config import TrainConfig
from aisyn.train.device import resolve_device
from aisyn.train.distributed import DistContext
from aisyn.train.engine import Engine
from aisyn.train.executor import LocalExecutor
from aisyn.train.lora import load_trainable, trainable_tensors
from aisyn.train.models import check_data_matches, describe_base
from aisyn.train.objective import SFTObjective, sft_eval_loss
from aisyn.train.regime import Regime
from aisyn.train.run import RunDir

log = logging.getLogger("aisyn.fl")

#: ``--local-optimizer kept``: the client's AdamW state, in its run folder
OPTIMIZERS = RoundFiles("optimizer", "adamw")


#: whether this process's start-up was already counted (or has none to count)
_started = False


def startup_s() -> float | None:
    """This process's start-up cost: its age at its first round, 0 after.

    A process that serves more than one round (a long-lived SuperNode, or
    every client of an in-process grid: :func:`no_startup`) started once;
    counting its age at every round would add hours of a long run to each."""
    global _started
    if _started:
        return 0.0
    _started = True
    return process_age_s()


def no_startup() -> None:
    """The clients of this process start nothing of their own (in-process)."""
    global _started
    _started = True


def process_age_s() -> float | None:
    """Seconds since this process started (Linux), to measure start-up cost."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class ClientNode:
    """A client's own settings (``--node-config``): never sent to the server."""

    name: str
    data: Path  # SFT folder of this organisation
    base: Path  # base model run folder (its copy of the pretrained model)
    out: Path  # this node's run folder
    ranks: int = 1  # data-parallel ranks of its local steps (aisyn.fl.ranks)

    @classmethod
    def from_node_config(cls, cfg: dict) -> ClientNode:
        missing = [k for k in ("name", "data", "base", "out") if k not in cfg]
        if missing:
            raise ValueError(
                f"node config lacks {missing} (start it with `aisyn fl client`)"
            )
        ranks = cfg.get("ranks", 1)
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise ValueError(
                f"node config: ranks must be a whole number >= 1, got {ranks!r}"
            )
        return cls(
            str(cfg["name"]),
            Path(cfg["data"]),
            Path(cfg["base"]),
            Path(cfg["out"]),
            ranks,
        )

    def to_node_config(self) -> dict:
        return {
            "name": self.name,
            "data": str(self.data),
            "base": str(self.base),
            "out": str(self.out),
            "ranks": self.ranks,
        }


class ClientContext:
    """Base model, data and run folder of one client, checked against the server."""

    def __init__(
        self,
        node: ClientNode,
        settings: FLSettings,
        fingerprint: str,
        device: torch.device | None = None,
        main: bool = True,
    ) -> None:
        t0 = time.perf_counter()
        self.node = node
        self.info = describe_base(node.base)
        if fingerprint and self.info.fingerprint != fingerprint:
            raise ValueError(
                f"client {node.name}: base model {node.base} "
                f"({self.info.fingerprint[:12]}) is not the server's "
                f"({fingerprint[:12]})"
            )
        try:
            self.data = SFTData.open(node.data, "train")
        except ValueError as e:
            raise ValueError(f"client {node.name}: {e}") from None
        check_data_matches(self.info, [self.data])
        #: the federation's settings (what the run folder records) and this
        #: client's own share of the work (``--local-epochs``: its own steps)
        self.federation = settings
        self.settings = settings.for_items(len(self.data))
        self.device = device or resolve_device(settings.train.device)
        self.model, self.trainable, self.spec = build_trainable(
            self.info, settings, self.device
        )
        self.run = RunDir(node.out)
        self._ensure_run_folder()
        if settings.tensorboard and main:  # (main: rank 0 of a multi-rank client)
            self.run.enable_tensorboard()
        self.load_s = time.perf_counter() - t0

    def _ensure_run_folder(self) -> None:
        if (self.run.path / "config.json").is_file():
            # a later round, or a resumed federation: it must be the same one
            saved = self.run.read_config().get("federated")
            differ = setting_differences(saved, self.federation.to_dict())
            if differ:
                raise ValueError(
                    f"client {self.node.name}: its run folder {self.run.path} "
                    f"holds a federation with other settings ({', '.join(differ)}); "
                    "give this federation another --out"
                )
            return
        start_run(
            self.run,
            self.federation,
            self.info,
            role="client",
            seq_len=self.data.seq_len,
            data=[self.node.data],
            name=self.node.name,
        )

    def load_global(
        self,
        arrays: ArrayRecord | None,
        config: ConfigRecord | None = None,
        run_id: int = 0,
    ) -> dict[str, torch.Tensor]:
        """The global model of the message (``arrays``), or of its staged chunks
        when the round is chunked (``arrays`` None, ``config`` its count)."""
        try:
            if arrays is not None:
                tensors = record_to_tensors(arrays, self.spec)
            else:
                tensors = self._staged_global(config, run_id)
        except ValueError as e:
            raise ValueError(
                f"client {self.node.name}: bad global model: {e}"
            ) from None
        load_trainable(self.trainable, tensors)
        return tensors

    def _staged_global(
        self, config: ConfigRecord | None, run_id: int
    ) -> dict[str, torch.Tensor]:
        d = dict(config or {})
        if chunks.COUNT_KEY not in d or not self.settings.max_message_mb:
            raise ValueError("the message carries no model and no chunk count")
        plan = chunks.plan_chunks(
            self.spec, chunks.limit_bytes(self.settings.max_message_mb)
        )
        arrays = chunks.load_staged_global(
            self.node.out,
            run_id,
            int(d.get("server-round", 0)),
            self.spec,
            plan,
            int(d[chunks.COUNT_KEY]),
        )
        self.received_bytes = sum(a.nbytes for a in arrays.values())
        return {k: torch.from_numpy(v) for k, v in arrays.items()}

    def control_correction(
        self, control: ArrayRecord | None, server_round: int
    ) -> ControlCorrection:
        """SCAFFOLD's correction of this round's steps: the server's ``c`` (sent
        with the model) against this client's ``c_i`` (in its run folder)."""
        if control is None:
            raise ValueError(
                f"client {self.node.name}: strategy scaffold, but the message "
                "carries no control variate"
            )
        try:
            server = record_to_tensors(control, self.spec)
            own = load_client_control(self.node.out, server_round, self.spec)
        except ValueError as e:
            raise ValueError(
                f"client {self.node.name}: bad control variate: {e}"
            ) from None
        return ControlCorrection(self.trainable, server, own)

    def valid_loss(self) -> float:
        try:
            valid = SFTData.open(self.node.data, "valid")
        except ValueError:
            valid = self.data  # no valid split: use the train items' head
        if not len(valid):  # (a small part of a Dirichlet deal may have none)
            valid = self.data
        n = self.settings.eval_items or None
        return sft_eval_loss(
            self.model, valid, batch_size=self.settings.train.batch_size, max_items=n
        )


@torch.no_grad()
def add_proximal_grad(
    trainable: Sequence[tuple[str, nn.Parameter]],
    anchor: dict[str, torch.Tensor],
    mu: float,
) -> float:
    """FedProx: the gradient of (mu/2)||w - w_global||^2, added in place.

    Returns the term's value. Added to the gradient directly (before clipping,
    as if it were part of the loss) instead of through autograd, which would
    keep a second copy of the graph over every parameter.
    """
    total = 0.0
    for name, p in trainable:
        diff = p.detach() - anchor[name]
        total += float(diff.pow(2).sum())
        if p.grad is None:
            p.grad = diff.mul(mu)
        else:
            p.grad.add_(diff, alpha=mu)
    return 0.5 * mu * total


def client_train(
    node: ClientNode,
    config: ConfigRecord,
    arrays: ArrayRecord | None,
    run_id: int = 0,
    control: ArrayRecord | None = None,
) -> tuple[dict[str, ArrayRecord], MetricRecord]:
    """One round of local training; returns the reply's ArrayRecords (the
    trainable tensors as ``arrays``; under SCAFFOLD, whose server ``control``
    variate came with the model, the client's ``delta c_i`` as ``control``)
    and the metrics.

    In a chunked round (``arrays`` None: the global model was staged chunk by
    chunk) the update is written for the server to pull (``aisyn.fl.chunks``)
    and no arrays are returned. With ``node.ranks`` > 1 the local steps run on
    that many data-parallel ranks (``aisyn.fl.ranks``)."""
    startup = startup_s()
    settings, fingerprint, server_round = settings_from_record(config)
    if not 1 <= server_round <= settings.rounds:
        raise ValueError(f"client {node.name}: bad server round {server_round}")
    scaffold = settings.strategy == "scaffold"
    if scaffold and node.ranks > 1:
        raise ValueError(
            f"client {node.name}: strategy scaffold runs a client's local steps "
            "on one rank; start it without --client-ranks"
        )
    ctx = ClientContext(node, settings, fingerprint)
    ctx.received_bytes = payload_bytes(arrays) if arrays is not None else 0
    anchor = ctx.load_global(arrays, config, run_id)
    correction = ctx.control_correction(control, server_round) if scaffold else None
    global_loss = ctx.valid_loss()
    t0 = time.perf_counter()
    if node.ranks > 1:
        from aisyn.fl.ranks import train_on_ranks

        trained, mean_loss, train_s = train_on_ranks(
            ctx, config, anchor, timeout=settings.round_timeout
        )
    else:
        mean_loss, train_s = local_steps(
            ctx, server_round, anchor, correction=correction
        )
        trained = trainable_tensors(ctx.trainable)
    reply: dict[str, ArrayRecord] = {}
    if arrays is None:  # chunked
        update = {
            k: v.detach().to("cpu", torch.float32).numpy() for k, v in trained.items()
        }
        chunks.save_update(node.out, run_id, server_round, update)
        sent = sum(v.nbytes for v in update.values())
    else:
        reply["arrays"] = tensors_to_record(trained)
        if correction is not None:
            new = correction.new_control()
            save_client_control(node.out, server_round, new)
            reply[CONTROL] = tensors_to_record(correction.delta(new))
        sent = sum(map(payload_bytes, reply.values()))
    ctx.run.log_metrics(
        {
            "round": server_round,
            "step": server_round * ctx.settings.local_steps,
            "round_loss": mean_loss,
            "global_valid_loss": global_loss,
            "bytes_received": ctx.received_bytes,
            "bytes_sent": sent,
            "startup_s": startup,
            "load_s": ctx.load_s,
            "train_s": train_s,
            "ranks": node.ranks,
            "elapsed_s": (startup or 0.0) + time.perf_counter() - t0 + ctx.load_s,
        }
    )
    ctx.run.plot(f"client {node.name}")
    ctx.run.close()
    metrics = MetricRecord(
        {
            "num-examples": len(ctx.data),
            "train-loss": mean_loss,
            "global-valid-loss": global_loss,
            "train-s": train_s,
            "startup-s": startup or 0.0,
            "load-s": ctx.load_s,
        }
    )
    return reply, metrics


def local_steps(
    ctx: ClientContext,
    server_round: int,
    anchor: dict[str, torch.Tensor],
    dist: DistContext | None = None,
    cfg: TrainConfig | None = None,
    correction: ControlCorrection | None = None,
) -> tuple[float, float]:
    """The round's E local steps of ``ctx``'s model (the local executor under
    the one regime; with ``dist``, this rank's share of every batch under DDP,
    ``cfg`` its per-rank micro-batches; with ``correction``, SCAFFOLD's on
    every gradient); returns the mean loss and seconds."""
    settings = ctx.settings
    E, cfg = settings.local_steps, cfg or settings.train
    dist = dist or DistContext()
    first = (server_round - 1) * E
    objective = SFTObjective([ctx.node.data], cfg, sources=[ctx.data])
    objective.start(ctx.device)
    objective.batches.skip(first * cfg.batch_size)  # resume this client's data order
    prox_mu = settings.proximal_mu if settings.strategy == "fedprox" else 0.0
    executor = LocalExecutor(
        ctx.model,
        ctx.trainable,
        cfg,
        method=settings.method_spec(),
        ctx=dist,
        lr_at=lambda step: settings.lr_at(server_round, step),
        regularizer=(
            (lambda: {"prox": add_proximal_grad(ctx.trainable, anchor, prox_mu)})
            if prox_mu > 0
            else correction
        ),
        # Each round is a fresh process with a fresh optimizer (the global
        # model replaces the weights): only the weights are worth keeping.
        resumable=False,
        hint=" (lower the learning rate?)",
    )
    kept = settings.local_optimizer == "kept"
    if kept:
        load_local_optimizer(ctx, executor.optimizer, server_round)
    regime = Regime(
        objective, executor, cfg, ctx.run, fields={"round": server_round}, keep=1
    )
    engine = Engine(
        ctx.run,
        total_steps=cfg.steps,
        log_every=10,
        desc=f"client {ctx.node.name}",
        progress=False,
        time_key="train_s",
        log_range_edges=True,
        plot=False,
        main=dist.is_main,
    )
    train_s = engine.run(regime, range(first, first + E))["elapsed_s"]  # + save
    if kept and dist.is_main:  # (every rank's moments are the same under DDP)
        names = {p: n for n, p in ctx.trainable}
        OPTIMIZERS.save(
            ctx.node.out,
            server_round,
            ckpt.optimizer_tensors(executor.optimizer, names),
        )
    return sum(regime.losses) / len(regime.losses), train_s


def load_local_optimizer(
    ctx: ClientContext, optimizer: torch.optim.Optimizer, server_round: int
) -> None:
    """``--local-optimizer kept``: the client's AdamW moments (and step count)
    of the latest round before ``server_round`` it trained, if any."""
    try:
        saved = OPTIMIZERS.read_before(ctx.node.out, server_round)
        if saved is not None:
            path, tensors = saved
            ckpt.load_optimizer_tensors(
                optimizer, dict(ctx.trainable), tensors, str(path)
            )
    except (ValueError, ckpt.CheckpointError) as e:
        raise ValueError(f"client {ctx.node.name}: bad kept optimizer: {e}") from None


def client_evaluate(
    node: ClientNode,
    config: ConfigRecord,
    arrays: ArrayRecord | None,
    run_id: int = 0,
) -> MetricRecord:
    """Validation loss of the global model on this client's valid items."""
    settings, fingerprint, server_round = settings_from_record(config)
    ctx = ClientContext(node, settings, fingerprint)
    ctx.load_global(arrays, config, run_id)
    loss = ctx.valid_loss()
    ctx.run.log_metrics({"round": server_round, "final_global_valid_loss": loss})
    return MetricRecord({"num-examples": len(ctx.data), "valid-loss": loss})
