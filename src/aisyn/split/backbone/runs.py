"""A compute party's runs: whose each is (bound to the data party that made it,
``check_owner``) and the vocabulary of the base it starts from
(``vocab_of_base``: a preset's, sized to the data party's tokenizer)."""

from __future__ import annotations

import hmac
import logging
from pathlib import Path

from aisyn.link.memory import IN_PROCESS
from aisyn.model.families import ModelConfig, with_vocab
from aisyn.model.segments import (
    DATA_PARTY,
    Partition,
    own_tensor_shapes,
)
from aisyn.split import protocol as proto
from aisyn.train import checkpoint as ckpt
from aisyn.train.run import RunDir

log = logging.getLogger(__name__)

#: the key of B's run config.json naming the data party the run is bound to
OWNER = "owner"


def check_owner(
    run: RunDir, run_id: str, identity: str, *, accept_unbound: bool = False
) -> None:
    """Refuse any data party but the one that created run ``run_id`` here.

    A run is bound to its creator's identity in its config.json (written with
    its first checkpoint). A run folder from before runs were bound has none,
    and one made in-process (``--mode local``) names no network identity:
    over the network either is refused -- whoever knew its id could otherwise
    claim it -- unless ``accept_unbound`` (a compute party its data party
    spawned, or an operator who says so), and its operator may bind it by
    hand; in-process, where nothing else can reach this party, it is accepted.
    """
    config = run.path / "config.json"
    if config.is_file():
        owner = run.read_config().get(OWNER)
    elif ckpt.complete_steps(run.checkpoints):
        owner = None  # checkpoints without a record of whose they are
    else:
        return  # a new run: bound to ``identity`` when its folder is made
    if owner == IN_PROCESS and identity != IN_PROCESS:
        # Made by --mode local, now served over the network: the data party's
        # network identity was never recorded, so this is no proof of it.
        owner = None
    if owner is None:
        if identity == IN_PROCESS or accept_unbound:
            return
        raise proto.ProtocolError(
            f"run {run_id} has no data party bound to it over the network (it was "
            "made in-process, or before runs were bound to their data party); its "
            "compute party's "
            f'operator can bind it to you by adding "{OWNER}": "{identity}" to the '
            "run's config.json there"
        )
    if not (
        isinstance(owner, str)
        and hmac.compare_digest(owner.encode(), identity.encode())
    ):
        raise proto.ProtocolError(
            f"run {run_id} belongs to another data party; this link's identity "
            f"({identity[:24]}...) may not train, evaluate or resume it"
        )


def vocab_shapes(cfg: ModelConfig, partition: Partition, party: str) -> bool:
    """Whether any of ``party``'s tensors changes shape with the vocabulary."""
    return own_tensor_shapes(with_vocab(cfg, 2), partition, party) != own_tensor_shapes(
        with_vocab(cfg, 3), partition, party
    )


def vocab_of_base(
    path: str | Path, cfg: ModelConfig, partition: Partition
) -> ModelConfig:
    """``cfg`` with the vocabulary of the base model at ``path``.

    ``aisyn train`` sizes a preset's vocabulary to its data's tokenizer, so a
    base made from ``--model 2.6B`` has the tokenizer's 8 000 rows, not the
    preset's 40 000; read it from the data party's embedding in the file (its
    shape, from the header). Anything wrong with the file is left for
    ``open_base`` to report in one line.
    """
    two = own_tensor_shapes(with_vocab(cfg, 2), partition, DATA_PARTY)
    three = own_tensor_shapes(with_vocab(cfg, 3), partition, DATA_PARTY)
    name = next((n for n in two if two[n] != three[n]), None)
    file = ckpt.model_file(path)
    if name is None or not file.is_file():
        return cfg
    pairs = enumerate(zip(two[name], three[name], strict=True))
    dim = next(i for i, (x, y) in pairs if x != y)
    try:
        with ckpt.opened(file) as f:
            if name not in f.keys():
                return cfg
            shape = f.get_slice(name).get_shape()
    except ckpt.CheckpointError:
        return cfg
    if len(shape) != len(two[name]) or shape[dim] == cfg.vocab_size:
        return cfg
    log.info(
        "vocabulary %d, the base's (the model config says %d)",
        shape[dim],
        cfg.vocab_size,
    )
    return with_vocab(cfg, shape[dim])
