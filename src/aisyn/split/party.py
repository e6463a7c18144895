"""One party's half of a split model: weights, optimizer, clipping, checkpoints.

Both parties use this; only what they run per round differs (see
``data_party.py`` and ``compute_party.py``). A party materialises only its own
modules, owns an AdamW over only its own parameters (``make_optimizer``, so
the update of every parameter is the unsplit one), and clips by the *global*
gradient norm: it contributes its local squared norm and receives the peer's.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path

import torch

from aisyn.model.causal_lm import parameter_seed
from aisyn.model.families import ModelConfig, build_model
from aisyn.model.segments import (
    COMPUTE_PARTY,
    DATA_PARTY,
    Partition,
    Segment,
    build_party_model,
    own_named_parameters,
    own_state_dict,
    own_tensor_shapes,
    segments_of,
)
from aisyn.split.backbone import shards
from aisyn.train import checkpoint as ckpt
from aisyn.train.config import TrainConfig
from aisyn.train.device import autocast_for
from aisyn.train.lora import Method, apply_method, lora_parameter_names
from aisyn.train.models import BaseModel
from aisyn.train.optim import make_optimizer
from aisyn.train.recompute import checkpoint_blocks
from aisyn.train.update import SkippedStep, apply_update, grad_sq_norm

log = logging.getLogger(__name__)


class PartyState:
    def __init__(
        self,
        cfg: ModelConfig,
        partition: Partition,
        party: str,
        train: TrainConfig,
        device: torch.device,
        *,
        seeds: dict[str, int] | None = None,
        method: Method | None = None,
        lora_seeds: dict[str, int] | None = None,
        frozen: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """``seeds``: per-parameter init seeds of this party's parameters, for a
        party that is not told the run's seed (the compute party); otherwise the
        parameters are initialised from ``train.seed``.

        ``method`` LoRA: once its weights are in place (``init_from`` a base),
        ``adapt`` freezes them and trains adapters on this party's blocks only;
        their ``A`` matrices are drawn from ``lora_seeds`` (the compute party's,
        given by the data party) or from ``train.seed``.

        ``frozen`` (LoRA only): the base's weights of this party, shared with
        other sessions over the same base (``build_party_model``): the model
        holds no copy of its own and needs no ``init_from``."""
        if frozen is not None and (method is None or method.name != "lora"):
            raise ValueError(
                "shared frozen weights are for LoRA, which never writes them"
            )
        self.cfg = cfg
        self.partition = partition
        self.party = party
        self.peer = "compute party" if party == DATA_PARTY else "data party"
        self.train_cfg = train
        self.device = device
        self.model = build_party_model(
            cfg,
            partition,
            party,
            seed=train.seed if seeds is None else None,
            seeds=seeds,
            device=device,
            frozen=frozen,
        )
        #: whether the weights are a base shared with other sessions
        self.shares_base = frozen is not None
        self.method = method or Method()
        self.lora_seeds = lora_seeds
        self.named = own_named_parameters(self.model, partition, party)
        self.params = [p for _, p in self.named]
        self.optimizer = make_optimizer(self.named, train)
        self.segments: tuple[Segment, ...] = segments_of(self.model, partition, party)
        if train.activation_checkpointing:
            checkpoint_blocks(self.model, cfg.layout)
        #: why this step cannot be applied, found while it ran (first reason)
        self.problem: str | None = None
        #: modules this party trains beside its blocks, outside the model
        #: (``attach``): saved in its checkpoints' private file
        self.private: dict[str, torch.nn.Module] = {}

    @property
    def lora(self) -> bool:
        return self.method.name == "lora"

    def attach(self, name: str, module: torch.nn.Module) -> None:
        """Train ``module``'s parameters with this party's, under the same
        optimizer, clipping and step (a data party's bottleneck at the cut);
        its state goes in the checkpoint's private file, not the model's
        (``adapt`` keeps it)."""
        module.to(self.device)
        self.private[name] = module
        self.named = self.named + [
            (f"{name}.{n}", p) for n, p in module.named_parameters()
        ]
        self.params = [p for _, p in self.named]
        self.optimizer = make_optimizer(self.named, self.train_cfg)

    def private_tensors(self) -> dict[str, torch.Tensor]:
        return {
            f"{name}.{k}": v.detach().contiguous()
            for name, m in self.private.items()
            for k, v in m.state_dict().items()
        }

    def adapt(self) -> None:
        """With LoRA: adapters on this party's blocks, everything else frozen,
        the optimizer over the adapters alone. Call once the base is loaded."""
        if not self.lora:
            return
        self.named = apply_method(
            self.model,
            self.method,
            self.train_cfg.seed,
            within=self.partition.module_paths(self.party),
            seeds=self.lora_seeds,
        ) + [
            (f"{name}.{n}", p)
            for name, m in self.private.items()
            for n, p in m.named_parameters()
        ]
        self.params = [p for _, p in self.named]
        self.optimizer = make_optimizer(self.named, self.train_cfg)

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    def autocast(self):
        """The training step's autocast (``--autocast``, which the compute
        party is told in the hello)."""
        return autocast_for(self.device, self.train_cfg.autocast)

    # --- the optimizer step ---------------------------------------------------

    def checked(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """A tensor received from the peer, noting (once) if it is not finite.

        The round goes on, so both parties stay in step; the step is then
        skipped on both sides (``local_sq_norm`` reports NaN to the peer).
        """
        if self.problem is None and not bool(torch.isfinite(t).all()):
            self.problem = f"non-finite values in {what} from the {self.peer}"
        return t

    def local_sq_norm(self) -> float:
        """This party's squared gradient norm (``grad_sq_norm``), or NaN when
        this step must be skipped (what the peer is sent)."""
        if self.problem is not None:
            return math.nan
        total = grad_sq_norm(self.params)
        if not math.isfinite(total):
            self.problem = "non-finite gradients on this party"
        return total

    def apply_step(self, step: int, sq_norm_a: float, sq_norm_b: float) -> float:
        """Clip by the global norm and step; returns the global norm.

        Both parties call this with the same two numbers in the same order, so
        they compute the same coefficient to the bit -- and take the same
        decision to skip: a squared norm that is NaN (a party found a problem),
        infinite or negative, or a sum that overflows, skips the step on both
        sides with ``SkippedStep``; the rest is the one update every regime
        takes (``train.update.apply_update``).
        """
        mine, theirs = (
            (sq_norm_a, sq_norm_b)
            if self.party == DATA_PARTY
            else (sq_norm_b, sq_norm_a)
        )
        total_sq = sq_norm_a + sq_norm_b
        reason = None
        if self.problem is not None:
            reason = self.problem
        elif not _valid_sq_norm(mine):
            reason = f"this party's squared gradient norm is {mine}"
        elif math.isnan(theirs):
            reason = f"the {self.peer} found non-finite values and skips the step"
        elif not _valid_sq_norm(theirs):
            reason = (
                f"the {self.peer} sent a squared gradient norm of {theirs!r} "
                "(must be finite and >= 0)"
            )
        elif not math.isfinite(total_sq):
            reason = f"the global squared gradient norm overflows ({total_sq})"
        if reason is not None:
            self.zero_grad()
            raise SkippedStep.at(step, reason, both_parties=True)
        return apply_update(
            self.optimizer,
            self.params,
            step=step,
            lr=self.train_cfg.lr_at(step),
            grad_clip=self.train_cfg.grad_clip,
            total_norm=math.sqrt(total_sq),
            both_parties=True,
        )

    def zero_grad(self) -> None:
        self.problem = None
        self.optimizer.zero_grad(set_to_none=True)

    # --- checkpoints ----------------------------------------------------------

    def tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """A checkpoint's files. A LoRA party saves its adapters alone: its
        base never changes, and it starts from the base again to resume."""
        names = {p: n for n, p in self.named}
        files = {
            ckpt.MODEL_FILE: self.weights(),
            ckpt.OPTIM_FILE: {
                **ckpt.optimizer_tensors(self.optimizer, names),
                **ckpt.rng_tensors(),
            },
        }
        if self.private:
            files[ckpt.PRIVATE_FILE] = self.private_tensors()
        return files

    def weights(self) -> dict[str, torch.Tensor]:
        """A checkpoint's model file: this party's weights (a LoRA party's
        adapters alone)."""
        if self.lora:
            return {n: p.detach().contiguous() for n, p in self.named}
        return own_state_dict(self.model, self.partition, self.party)

    def init_from(self, base: BaseModel) -> None:
        """Load this party's weights, and only those, from a base model."""
        shapes = own_tensor_shapes(self.cfg, self.partition, self.party)
        whose = f"party {self.party} needs (cut {self.partition.spec})"
        tensors = ckpt.read_some_tensors(base.checkpoint, shapes, whose)
        load_own_weights(self, tensors, str(base.checkpoint))

    def load(self, folder: Path, *, rank: int = 0, world: int = 1) -> dict:
        """Load this party's weights, optimizer and RNG from a checkpoint folder;
        returns its state.json. ``rank`` of ``world``: which rank of a
        pipelined compute party this is (``split.backbone.shards``: any world size
        reads a checkpoint any other saved)."""
        state = ckpt.read_state(folder)
        if state.get("party") not in (None, self.party):
            raise ckpt.CheckpointError(
                f"{folder}: a checkpoint of party {state.get('party')}, not "
                f"{self.party}"
            )
        if shards.saved_world(state, folder) == 1 and self.partition.share is None:
            weights = ckpt.read_tensors(folder / ckpt.MODEL_FILE)
            opt = ckpt.read_tensors(folder / ckpt.OPTIM_FILE)
        else:
            weights, opt = self._read_share(folder, rank, world)
        source = str(folder / ckpt.MODEL_FILE)
        if self.lora:
            load_adapters(self, weights, source)
        else:
            load_own_weights(self, weights, source)
        if self.private:
            self.load_private(folder)
        ckpt.load_optimizer_tensors(
            self.optimizer, dict(self.named), opt, str(folder / ckpt.OPTIM_FILE)
        )
        ckpt.restore_rng(opt)
        return state

    def load_private(self, folder: Path) -> None:
        """The attached modules' state from checkpoint ``folder``."""
        path = folder / ckpt.PRIVATE_FILE
        if not path.is_file():
            raise ckpt.CheckpointError(
                f"{folder}: no {ckpt.PRIVATE_FILE}, which this run's "
                f"{', '.join(self.private)} is saved in (a checkpoint of a run "
                "without it?)"
            )
        expected = {
            f"{name}.{k}": v
            for name, m in self.private.items()
            for k, v in m.state_dict().items()
        }
        with torch.no_grad():
            ckpt.load_exactly(
                expected,
                ckpt.read_tensors(path),
                str(path),
                f"party {self.party}'s {', '.join(self.private)}",
            )

    def _read_share(
        self, folder: Path, rank: int, world: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(weights, optimizer + RNG tensors) of this party's blocks from the
        shares of a step that several ranks saved (or of a whole one)."""
        named = dict(self.named)
        if self.lora:
            mine, every = set(named), None
        else:
            mine = set(own_state_dict(self.model, self.partition, self.party))
            whole = replace(self.partition, share=None)
            every = set(own_tensor_shapes(self.cfg, whole, self.party))
        weights = shards.read_share(folder, ckpt.MODEL_FILE, mine.__contains__, every)
        opt = shards.read_share(
            folder, ckpt.OPTIM_FILE, lambda k: k.rpartition("::")[0] in named
        )
        return weights, {**opt, **shards.rank_rng(folder, rank, world)}


def open_base(
    path: str | Path, cfg: ModelConfig, partition: Partition, party: str
) -> BaseModel:
    """Check that a base (run folder, checkpoint folder or .safetensors file)
    holds ``party``'s tensors with the right shapes, and fingerprint it.

    Reads only the data party's tensors; B's own are checked by shape here
    and read when a session starts (``PartyState.init_from``).
    """
    file = ckpt.model_file(path)
    if party != DATA_PARTY:
        ckpt.read_some_tensors(
            file,
            own_tensor_shapes(cfg, partition, party),
            f"party {party} needs (cut {partition.spec})",
            read=False,
        )
    whose = (
        f"party {DATA_PARTY} needs (cut {partition.spec})"
        if party == DATA_PARTY
        else f"of party {DATA_PARTY} (cut {partition.spec}) that the compute party "
        "checks the data party's base against: give it the whole base model"
    )
    data = ckpt.read_some_tensors(
        file, own_tensor_shapes(cfg, partition, DATA_PARTY), whose
    )
    return BaseModel(file, ckpt.tensors_fingerprint(data))


def _valid_sq_norm(x: float) -> bool:
    return math.isfinite(x) and x >= 0.0


def base_label(fingerprint: str | None) -> str:
    return f"base {fingerprint[:12]}" if fingerprint else "random init"


def load_adapters(
    party: PartyState, tensors: dict[str, torch.Tensor], source: str
) -> None:
    """Strict load of exactly this LoRA party's adapter tensors."""
    what = f"party {party.party}'s LoRA adapters"
    ckpt.load_exactly(dict(party.named), tensors, source, what)


def load_own_weights(
    party: PartyState, tensors: dict[str, torch.Tensor], source: str
) -> None:
    """Strict load of exactly this party's tensors (no more, no fewer)."""
    expected = own_state_dict(party.model, party.partition, party.party)
    what = f"party {party.party}'s half of this cut"
    ckpt.load_exactly(expected, tensors, source, what)


def run_methods(config: dict) -> tuple[Method, Method]:
    """(data party's, compute party's) training method of a split run's
    config.json (full for runs recorded before LoRA existed)."""
    a = Method.from_dict(config.get("method") or {})
    b = Method.from_dict(config.get("compute_method") or {})
    return a, b


def compute_lora_hello(
    cfg: ModelConfig, partition: Partition, method: Method, seed: int
) -> dict | None:
    """The hello's ``lora`` object for LoRA on B's blocks (None: full): the
    seeds of B's ``A`` matrices, each keyed by the run's seed as the data
    party's own are, so that B draws what the unsplit model would."""
    if method.name != "lora":
        return None
    names = lora_parameter_names(
        build_model(cfg, device="meta"),
        method,
        within=partition.module_paths(COMPUTE_PARTY),
    )
    seeds = {n: parameter_seed(seed, n) for n in names if ".lora_A." in n}
    return {"rank": method.rank, "alpha": method.alpha, "seeds": seeds}


def place_weights(
    state: PartyState,
    base: BaseModel | None,
    start: Path | None,
    *,
    fresh_train: bool,
    rank: int = 0,
    world: int = 1,
) -> dict | None:
    """Put a party's weights in place: a LoRA party loads the base and adds
    its adapters first (its checkpoints hold only those); then the checkpoint
    ``start`` is loaded (its state.json returned), or for a fresh training run
    the base. Raises ValueError for LoRA without a base."""
    if state.lora:
        if base is None:
            raise ValueError(
                "LoRA trains adapters on a base model: give --init-from BASE "
                "(or --model hf:DIR)"
            )
        if not state.shares_base:  # else they are in place already
            state.init_from(base)
        state.adapt()
    if start is not None:
        return state.load(start, rank=rank, world=world)
    if fresh_train and base is not None and not state.lora:
        state.init_from(base)
    return None
