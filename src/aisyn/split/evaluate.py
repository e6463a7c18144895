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
from collections.abc import Iterator
from pathlib import Path

import torch

from aisyn.model.pangu import PanguConfig
from aisyn.model.segments import DATA_PARTY, Partition
from aisyn.split import protocol as proto
from aisyn.split.data_party import DataSession, SplitModel
from aisyn.split.party import PartyState
from aisyn.split.session import SplitOptions, open_session
from aisyn.split.transport import LinkSettings
from aisyn.train import checkpoint as ckpt
from aisyn.train.loop import TrainConfig
from aisyn.train.run import RunDir


def split_options(config: dict, peer: LinkSettings | None = None) -> SplitOptions:
    d = dict(config["split"])
    d["peer"] = LinkSettings.from_dict(d["peer"]) if d.get("peer") else None
    opts = SplitOptions(**d)
    if peer is not None:
        opts = dataclasses.replace(opts, mode="grpc", peer=peer, spawn_backbone=False)
    return opts


@contextlib.contextmanager
def open_split_model(
    run: str | Path,
    device: str | torch.device = "cpu",
    *,
    peer: LinkSettings | None = None,
) -> Iterator[SplitModel]:
    run_dir = RunDir(run)
    config = run_dir.read_config()
    if config.get("kind") != "split":
        raise ValueError(f"{run_dir.path}: not a split run (kind {config.get('kind')})")
    mcfg = PanguConfig.from_dict(config["model"])
    partition = Partition.from_dict(config["partition"])
    train = TrainConfig.from_dict(config["train"])
    last = ckpt.latest(run_dir.checkpoints)
    if last is None:
        raise ckpt.CheckpointError(f"{run_dir.path}: split run has no checkpoint yet")
    state = PartyState(mcfg, partition, DATA_PARTY, train, torch.device(device))
    step = state.load(last)["step"]
    state.train(False)
    opts = split_options(config, peer)
    hello = proto.hello(
        purpose="eval",
        run_id=config["run_id"],
        model=mcfg.to_dict(),
        partition=partition.to_dict(),
        train=train,
        eval_step=step,
        codec=opts.codec,
    )
    eod_id = config["tokenizer"]["eod_id"] if train.eod_reset else None
    with open_session(run_dir, mcfg, partition, hello, opts, str(device)) as opened:
        yield SplitModel(DataSession(state, opened.link, eod_id=eod_id))


def evaluate_split_run(
    run: str | Path, *, peer: LinkSettings | None = None, **kwargs
) -> dict:
    """``evaluate_run`` on a split run (same arguments; ``peer`` overrides the
    recorded compute party)."""
    from aisyn.eval.report import evaluate_run
    from aisyn.train.loop import resolve_device

    device = resolve_device(kwargs.get("device", "auto"))
    with open_split_model(run, device, peer=peer) as model:
        return evaluate_run(run, model=model, **kwargs)
