"""Evaluating a split run through the link: tokens never leave the data party.

``aisyn eval --run RUN`` on a split run comes here (``aisyn.cli`` chooses
this evaluator for a run of kind ``split``): A loads its half at its latest
checkpoint, opens an evaluation session with the compute party (in-process for
``--mode local`` runs, a freshly spawned one for ``--spawn-backbone`` runs,
otherwise the recorded ``--peer``, or the one given to ``aisyn split eval``),
asks it to load the same step, and hands ``evaluate_run`` a
:class:`SplitModel`, on which test loss and cloze scoring run unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
from collections.abc import Iterator
from pathlib import Path

import torch

from aisyn.model.families import config_from_dict
from aisyn.model.segments import DATA_PARTY, Partition
from aisyn.split import protocol as proto
from aisyn.split.client.data_party import DataSession, SplitModel
from aisyn.split.defence import cut_dp as dp
from aisyn.split.defence.attach import attach_bottleneck
from aisyn.split.party import (
    PartyState,
    compute_lora_hello,
    open_base,
    place_weights,
    run_methods,
)
from aisyn.split.session import SplitOptions, open_session
from aisyn.split.transport import LinkSettings
from aisyn.train import checkpoint as ckpt
from aisyn.train.config import TrainConfig
from aisyn.train.run import RunDir


def split_options(
    config: dict, peer: LinkSettings | None = None, mode: str | None = None
) -> SplitOptions:
    """How to reach the compute party of a run: as recorded, or ``peer`` (gRPC),
    or ``mode`` local (the in-process one, in the run's folder)."""
    d = dict(config["split"])
    d["peer"] = LinkSettings.from_dict(d["peer"]) if d.get("peer") else None
    opts = SplitOptions(**d)
    if mode == "local" and peer is not None:
        raise ValueError("--peer needs --mode grpc")
    if mode == "local":
        opts = dataclasses.replace(opts, mode="local", peer=None, spawn_backbone=False)
    elif peer is not None:
        opts = dataclasses.replace(opts, mode="grpc", peer=peer, spawn_backbone=False)
    elif mode == "grpc" and opts.mode == "local":
        raise ValueError(
            "--mode grpc: this run's compute party ran in-process; give --peer "
            "HOST:PORT of a compute party serving it"
        )
    return opts


def split_run_config(
    run_dir: RunDir, hint: str = "give the folder `aisyn split train --out` wrote"
) -> dict:
    """The config.json of a split run's data party; ValueError, ending in
    ``hint``, for any other folder."""
    config = run_dir.read_config()
    if config.get("kind") != "split":
        raise ValueError(
            f"{run_dir.path}: not a split run's data party (kind "
            f"{config.get('kind')}); {hint}"
        )
    return config


@contextlib.contextmanager
def open_data_session(
    run: str | Path,
    device: str | torch.device = "cpu",
    *,
    purpose: str = "eval",
    peer: LinkSettings | None = None,
    mode: str | None = None,
) -> Iterator[tuple[DataSession, dict]]:
    """A forward-only session (``purpose`` eval or generate) of a split run's
    data party at its latest checkpoint, and the run's config.json; the
    compute party loads the same step. ``peer`` overrides the recorded compute
    party, ``mode`` local uses the in-process one of a ``--mode local`` run."""
    run_dir = RunDir(run)
    config = split_run_config(run_dir)
    mcfg = config_from_dict(config["model"])
    partition = Partition.from_dict(config["partition"], mcfg.layout)
    train = TrainConfig.from_dict(config["train"])
    last = ckpt.latest(run_dir.checkpoints)
    if last is None:
        raise ckpt.CheckpointError(f"{run_dir.path}: split run has no checkpoint yet")
    method, compute_method = run_methods(config)
    state = PartyState(
        mcfg, partition, DATA_PARTY, train, torch.device(device), method=method
    )
    # A LoRA run's checkpoints hold adapters; its weights come from the base.
    init_from = (
        config.get("init_from") if state.lora or compute_method.name == "lora" else None
    )
    base = open_base(init_from, mcfg, partition, DATA_PARTY) if init_from else None
    defence = dp.CutDefence.from_dict(config.get("cut_defence"))
    bottleneck = attach_bottleneck(state, defence)  # loaded with A's weights
    step = place_weights(state, base, last, fresh_train=False)["step"]
    state.train(False)
    opts = split_options(config, peer, mode)
    hello = proto.hello(
        purpose=purpose,
        run_id=config["run_id"],
        model=mcfg.to_dict(),
        partition=partition.to_dict(),
        train=train,
        eval_step=step,
        codec=opts.codec,
        lora=compute_lora_hello(mcfg, partition, compute_method, train.seed),
    )
    eod_id = config["tokenizer"]["eod_id"] if train.eod_reset else None
    # What crosses after training passes the run's defence too, with noise
    # fresh to this session: noise reused across sessions on other inputs
    # would cancel in their difference.
    guard = (
        dp.CutGuard(defence, secrets.randbits(63), bottleneck)
        if defence.active
        else None
    )
    # An in-process compute party with LoRA adapters needs the base too.
    with open_session(
        run_dir, mcfg, partition, hello, opts, str(device), init_from
    ) as opened:
        yield DataSession(state, opened.link, eod_id=eod_id, guard=guard), config


@contextlib.contextmanager
def open_split_model(
    run: str | Path,
    device: str | torch.device = "cpu",
    *,
    peer: LinkSettings | None = None,
) -> Iterator[SplitModel]:
    with open_data_session(run, device, peer=peer) as (session, _):
        yield SplitModel(session)


def evaluate_split_run(
    run: str | Path, *, peer: LinkSettings | None = None, **kwargs
) -> dict:
    """``evaluate_run`` on a split run (same arguments; ``peer`` overrides the
    recorded compute party)."""
    from aisyn.eval.report import evaluate_run
    from aisyn.train.device import resolve_device

    device = resolve_device(kwargs.get("device", "auto"))
    with open_split_model(run, device, peer=peer) as model:
        return evaluate_run(run, model=model, **kwargs)
