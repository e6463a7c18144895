"""Party B, the compute party: runs the middle blocks for a data party.

B holds its own model config and cut (it must materialise its weights), takes
the optimisation settings from A's hello, and keeps one run folder per data
party run under its ``root`` (``root/<run id>/``). Every session starts from
B's own checkpoint on disk (or, at step 0, the seeded init or the base model of
``--init-from``) and nothing a session does reaches disk except through a
``SAVE`` round, so a session that breaks the protocol, or a peer that vanishes,
leaves B's saved state untouched.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
from dataclasses import KW_ONLY, dataclass
from pathlib import Path

import torch

from aisyn.link.base import Link
from aisyn.link.errors import HandshakeError
from aisyn.model.families import ModelConfig, build_model, hf_folder, with_vocab
from aisyn.model.segments import (
    COMPUTE_PARTY,
    Partition,
    PartitionError,
    own_tensor_shapes,
)
from aisyn.split import protocol as proto
from aisyn.split.backbone import shards
from aisyn.split.backbone.pipeline import PipelinedRounds, ShardedRounds
from aisyn.split.backbone.ranks import Ranks, announce_session
from aisyn.split.backbone.rounds import Rounds
from aisyn.split.backbone.runs import OWNER, check_owner, vocab_of_base, vocab_shapes
from aisyn.split.centre.tenant_batch import AdapterBatcher
from aisyn.split.party import (
    PartyState,
    base_label,
    open_base,
    place_weights,
)
from aisyn.train import checkpoint as ckpt
from aisyn.train.config import TrainConfig
from aisyn.train.device import resolve_device
from aisyn.train.lora import Method, lora_parameter_names
from aisyn.train.run import RunDir

log = logging.getLogger(__name__)


#: the largest vocabulary a data party may announce (B never allocates it)
MAX_VOCAB = 1 << 24


@dataclass
class Session:
    """What B agreed to in one handshake."""

    purpose: str
    run_id: str
    train: TrainConfig
    start_step: int
    codec: str = "none"
    #: init seeds of B's parameters (a fresh run from random init)
    seeds: dict[str, int] | None = None
    #: LoRA on B's frozen blocks: (method, seeds of the A matrices)
    lora: tuple[Method, dict[str, int]] | None = None
    _: KW_ONLY
    #: the run's model config: B's, with the data party's vocabulary when
    #: B's own tensors do not depend on it (see ComputeParty.session_config)
    cfg: ModelConfig | None = None
    #: the identity of the data party this session's run is bound to
    owner: str = ""
    #: the hello it was agreed from (the other ranks of a pipelined compute
    #: party agree to it again, each against its own checkpoints)
    hello: str = ""
    #: the tenant it is for when a centre serves several (``split.centre.tenants``):
    #: its runs live under ``root/<tenant>/``
    tenant: str = ""
    #: the session's hold on its tenant's quotas (``tenants.Lease``), if any
    lease: object = None
    #: how it ended, for the operator's record ("ended", "failed: ...")
    outcome: str = ""
    #: B's blocks run forward only, from the base (``--backbone frozen``)
    frozen: bool = False


class ComputeParty:
    def __init__(
        self,
        cfg: ModelConfig,
        partition: Partition,
        root: str | Path | None,
        *,
        device: str = "cpu",
        keep_checkpoints: int = 2,
        init_from: str | Path | None = None,
        accept_unbound: bool = False,
    ) -> None:
        """``accept_unbound``: a run made before runs were bound to their data
        party is open to any (for a party only its own data party reaches)."""
        if not partition.is_u_shape:
            raise PartitionError(
                f"cut {partition.spec}: split training needs a U-shape cut "
                "(u:FRONT,BACK); a two-way cut would send the labels to party B"
            )
        if partition.layout != cfg.layout:
            raise PartitionError(
                f"cut {partition.spec} is for a {partition.layout.family} model of "
                f"{partition.layout.num_layers} layers, this is a "
                f"{cfg.layout.family} model of {cfg.layout.num_layers}"
            )
        if init_from and hf_folder(init_from) is None:
            cfg = vocab_of_base(init_from, cfg, partition)
        self.cfg = cfg
        self.partition = partition
        self.root = Path(root) if root is not None else None
        self.device = resolve_device(device)
        self.keep = keep_checkpoints
        self.accept_unbound = accept_unbound
        #: B's tensors of the base, shared by the LoRA sessions (frozen_base)
        self._frozen: dict[str, torch.Tensor] | None = None
        self._frozen_lock = threading.Lock()
        #: whether LoRA sessions over that base run their micro-batches
        #: through it together (``split.centre.tenant_batch``; a centre's option)
        self.batch_tenants = False
        self._batchers: dict[tuple, AdapterBatcher] = {}
        #: the torchrun job this party's blocks are spread over (None: this
        #: process holds them all); see ``split.backbone.pipeline``
        self.ranks: Ranks | None = None
        self.own_parameters = partition.parameter_names(
            build_model(cfg, device="meta"), COMPUTE_PARTY
        )
        #: whether the vocabulary is this party's to fix: a base fixes it (its
        #: embedding, and the data party's fingerprint of it), and so do any
        #: tensors of B's that depend on it; otherwise each run takes the data
        #: party's, as ``aisyn train`` sizes a preset to the data's tokenizer
        self.vocab_fixed = init_from is not None or vocab_shapes(
            cfg, partition, COMPUTE_PARTY
        )
        # Checked (and fingerprinted) now, so a bad base fails at startup; B's
        # tensors are read from it when a fresh session starts.
        self.base = (
            open_base(init_from, cfg, partition, COMPUTE_PARTY) if init_from else None
        )
        if self.base is not None:
            log.info(
                "fresh runs start from %s (%s)",
                self.base.checkpoint,
                base_label(self.base.fingerprint),
            )
        if not self.vocab_fixed:
            log.info(
                "the vocabulary follows each data party's tokenizer (this party "
                "holds no tensor of the vocabulary's size)"
            )

    def session_config(self, theirs: object) -> ModelConfig:
        """B's model config for a data party that announces ``theirs``: with
        its vocabulary when that is not this party's to fix (``vocab_fixed``)."""
        if self.vocab_fixed or not isinstance(theirs, dict):
            return self.cfg
        vocab = theirs.get("vocab_size")
        if type(vocab) is not int or not 0 < vocab <= MAX_VOCAB:
            return self.cfg  # the comparison below names the difference
        return with_vocab(self.cfg, vocab)

    # --- handshake -------------------------------------------------------------

    def run_dir(self, run_id: str, tenant: str = "") -> RunDir | None:
        """Run ``run_id``'s folder (of ``tenant``'s runs, when tenants are
        served; its name was checked to be a plain folder name)."""
        if self.root is None:
            return None
        return RunDir((self.root / tenant if tenant else self.root) / run_id)

    def negotiate(
        self, hello_text: str, identity: str, tenant: str = ""
    ) -> tuple[str, Session]:
        """Check A's hello; returns (reply JSON, session). ``identity`` is the
        data party as its link vouches for it (``PeerHello.identity``), or the
        tenant it was found to be (``Tenant.owner``): a run is bound to the
        identity that created it. ``tenant`` names the folder its runs are in.
        Raises HandshakeError with a one-line reason to refuse (B stays up
        either way)."""
        try:
            return self._negotiate(hello_text, identity, tenant)
        except (ValueError, TypeError, OSError) as e:  # ProtocolError: ValueError
            raise HandshakeError(f"compute party refused the session: {e}") from None

    def _negotiate(
        self, hello_text: str, identity: str, tenant: str
    ) -> tuple[str, Session]:
        if not identity:
            # Nothing vouches for this peer: it could pass for any run's owner.
            raise proto.ProtocolError("the link does not identify the data party")
        h = proto.parse_hello(hello_text)
        run_id, purpose = h.run_id, h.purpose
        run = self.run_dir(run_id, tenant)
        if run is not None:
            # First: a stranger learns nothing of another's run (not its steps).
            check_owner(run, run_id, identity, accept_unbound=self.accept_unbound)
        theirs = h.model
        cfg = self.session_config(theirs)
        mine = cfg.to_dict()
        if theirs != mine:
            diff = (
                # both sides' keys: a config may leave out a default field
                sorted(k for k in mine | theirs if mine.get(k) != theirs.get(k))
                if isinstance(theirs, dict)
                else ["<not an object>"]
            )
            raise proto.ProtocolError(
                f"model config differs from this compute party's in {diff}"
            )
        if h.partition != self.partition.to_dict():
            raise proto.ProtocolError(
                f"cut {h.partition} differs from this compute party's "
                f"{self.partition.to_dict()} ({self.partition.spec})"
            )
        seeds = proto.parse_init_seeds(h.init_seeds, self.own_parameters)
        lora = proto.parse_lora(h.lora, self.lora_a_names)
        if lora is not None and self.base is None:
            raise proto.ProtocolError(
                "LoRA on the compute party's blocks trains adapters on a base "
                "model, and this compute party has none: start it with "
                "--init-from BASE (or --model hf:DIR)"
            )
        frozen = purpose == "train" and h.backbone == "frozen"
        if frozen and (why := self._cannot_freeze(lora)):
            raise proto.ProtocolError(why)
        b_steps = shards.complete_steps(run.checkpoints) if run is not None else []
        if purpose in ("eval", "generate"):
            step = h.eval_step
            if not isinstance(step, int) or step not in b_steps:
                raise proto.ProtocolError(
                    f"run {run_id}: no checkpoint at step {step} to {purpose} from "
                    f"(this party has {b_steps or 'none'})"
                )
            start = step
        elif not h.resume:
            if b_steps:
                raise proto.ProtocolError(
                    f"run {run_id} already has checkpoints here (steps {b_steps}); "
                    "resume it"
                )
            start = 0
        else:
            common = sorted(set(h.a_steps) & set(b_steps))
            if common:
                start = common[-1]
            elif not h.a_steps and not b_steps:
                start = 0
            else:
                raise proto.ProtocolError(
                    f"run {run_id}: no checkpoint step both parties have (data "
                    f"party {h.a_steps or 'none'}, compute party {b_steps or 'none'})"
                )
        mine_init = self.base.fingerprint if self.base else None
        fresh = purpose == "train" and start == 0
        if fresh and h.init != mine_init:
            # Each side loads its own part of the base: a fresh run from two
            # different starting points would train a model that never existed.
            raise proto.ProtocolError(
                f"the data party starts from {base_label(h.init)}, this compute "
                f"party from {base_label(mine_init)}; a fresh run needs both to "
                "--init-from the same base model"
            )
        if fresh and self.base is None and seeds is None:
            raise proto.ProtocolError(
                "hello: a fresh run from random init needs the init seeds of this "
                "party's parameters"
            )
        if start:
            # Fail the handshake, with the reason, rather than the first round.
            assert run is not None
            folder = ckpt.step_folder(run.checkpoints, start)
            state = ckpt.read_state(folder)
            if missing := shards.missing_files(folder):
                raise ckpt.CheckpointError(f"{missing[0]}: missing")
            if state.get("run_id") != run_id:
                raise ckpt.CheckpointError(f"{folder}: belongs to another run")
        # Nothing is written here: a refused, failed or fuzzed session leaves
        # B's disk as it was. config.json comes with the first checkpoint.
        return proto.encode_json(proto.reply(start, b_steps)), Session(
            purpose,
            run_id,
            h.train,
            start,
            h.codec,
            seeds,
            lora,
            cfg=cfg,
            owner=identity,
            hello=hello_text,
            tenant=tenant,
            frozen=frozen,
        )

    def _cannot_freeze(self, lora: object) -> str | None:
        """Why this party cannot run a frozen backbone (None: it can)."""
        if self.base is None:
            return (
                "a frozen backbone runs the base model's blocks, and this compute "
                "party has none: start it with --init-from BASE (or --model hf:DIR)"
            )
        if lora is not None:
            return "a frozen backbone trains nothing here: LoRA on its blocks is void"
        if self.ranks is not None:
            return (
                "a frozen backbone runs on a one-process compute party (this one "
                "runs over ranks)"
            )
        return None

    def frozen_base(self, cfg: ModelConfig) -> dict[str, torch.Tensor]:
        """This party's tensors of the base, read once and kept on its device
        for every LoRA session (they share it: none writes it)."""
        assert self.base is not None  # negotiate() refuses LoRA without one
        with self._frozen_lock:
            if self._frozen is None:
                shapes = own_tensor_shapes(cfg, self.partition, COMPUTE_PARTY)
                whose = f"party {COMPUTE_PARTY} needs (cut {self.partition.spec})"
                tensors = ckpt.read_some_tensors(self.base.checkpoint, shapes, whose)
                self._frozen = {
                    n: t.to(self.device).requires_grad_(False)
                    for n, t in tensors.items()
                }
                log.info(
                    "holding the base's %d tensors for the LoRA sessions",
                    len(self._frozen),
                )
            return self._frozen

    def batcher_for(self, session: Session, state: PartyState) -> AdapterBatcher | None:
        """The batched path for ``session``'s training micro-batches: one per
        set of adapted layers and checkpointing (None: it runs its own, as
        any session does unless ``batch_tenants``, LoRA over the shared base,
        and a one-process party)."""
        if not (self.batch_tenants and state.shares_base and self.ranks is None):
            return None
        method = state.method
        targets = sorted(
            {
                n.rsplit(".lora_", 1)[0]
                for n in lora_parameter_names(
                    build_model(state.cfg, device="meta"),
                    method,
                    within=self.partition.module_paths(COMPUTE_PARTY),
                )
            }
        )
        ac = bool(session.train.activation_checkpointing)
        key = (tuple(targets), ac, json.dumps(state.cfg.to_dict(), sort_keys=True))
        with self._frozen_lock:
            if key not in self._batchers:
                self._batchers[key] = AdapterBatcher(
                    state.cfg,
                    self.partition,
                    self._frozen,
                    self.device,
                    activation_checkpointing=ac,
                    targets=targets,
                )
            return self._batchers[key]

    def lora_a_names(self, method: Method) -> list[str]:
        """The ``A`` matrices of LoRA ``method`` on this party's blocks."""
        names = lora_parameter_names(
            build_model(self.cfg, device="meta"),
            method,
            within=self.partition.module_paths(COMPUTE_PARTY),
        )
        return [n for n in names if ".lora_A." in n]

    def run_config(self, session: Session) -> dict:
        """B's record of a run (its config.json): B's own settings and what the
        data party told it, nothing else; and who that data party is."""
        return {
            "kind": "split-compute",
            "run_id": session.run_id,
            # The run is bound to it: check_owner() refuses every other.
            OWNER: session.owner,
            "model": (session.cfg or self.cfg).to_dict(),
            "partition": self.partition.to_dict(),
            "train": proto.compute_party_train(session.train),
            "device": str(self.device),
            # the ranks of the torchrun job B's blocks ran over
            # (split.backbone.pipeline)
            "world_size": 1 if self.ranks is None else self.ranks.world,
            # LoRA: B's checkpoints hold its adapters; its weights are the base's
            "lora": (
                None
                if session.lora is None
                else {"rank": session.lora[0].rank, "alpha": session.lora[0].alpha}
            ),
            "init_from": str(self.base.checkpoint) if self.base else None,
            # frozen: B's blocks stayed the base's (forward only, no gradient)
            "backbone": "frozen" if session.frozen else "train",
        }

    def save_checkpoint(self, session: Session, state: PartyState, step: int) -> Path:
        """Checkpoint ``state`` as step ``step`` of ``session``'s run (this
        process holding all of B's blocks); returns the folder. A run's first
        save makes its folder; if that save fails, no folder is left to pass
        for a run (nor for one bound to its data party). Raises OSError or
        CheckpointError."""
        run = self.run_dir(session.run_id, session.tenant)
        assert run is not None  # the caller checks that this party has a root
        new_folder = not run.path.exists()
        try:
            if not (run.path / "config.json").is_file():
                run.create(self.run_config(session), resume=False)
            return ckpt.save(
                run.checkpoints,
                step,
                state.tensors(),
                {
                    "party": COMPUTE_PARTY,
                    "run_id": session.run_id,
                    "model": state.cfg.to_dict(),
                    "partition": self.partition.to_dict(),
                    "train": proto.compute_party_train(session.train),
                },
                keep=self.keep,
            )
        except (OSError, ckpt.CheckpointError):
            if new_folder:
                shutil.rmtree(run.path, ignore_errors=True)
            raise

    # --- one session -------------------------------------------------------------

    def serve_session(
        self,
        link: Link,
        session: Session,
        *,
        first_round_timeout_s: float | None = None,
    ) -> None:
        """Run rounds until A closes the link (or it fails: raises LinkError).
        ``first_round_timeout_s`` bounds the wait for the first round (None:
        the link's own receive timeout, as for every later one)."""
        ranks = self.ranks
        if ranks is not None and ranks.rank == 0:
            announce_session(ranks, session)  # the other ranks build theirs too
        state = self.session_state(session)
        rounds = Rounds
        if ranks is not None:
            rounds = ShardedRounds if ranks.sharded else PipelinedRounds
        rounds(self, state, link, session, first_round_timeout_s).run()

    def session_state(self, session: Session) -> PartyState:
        """B's weights and optimizer for ``session``, in place: from its run's
        checkpoint, the base or the seeded init (this rank's share of them in
        a torchrun party)."""
        method, lora_seeds = session.lora or (None, None)
        ranks = self.ranks
        partition, seeds = self.partition, session.seeds
        if ranks is not None:
            partition = ranks.share(self.partition)
            if seeds is not None:  # of this rank's parameters only
                mine = partition.parameter_names(
                    build_model(session.cfg or self.cfg, device="meta"), COMPUTE_PARTY
                )
                seeds = {n: seeds[n] for n in mine}
        cfg = session.cfg or self.cfg
        # LoRA never writes the base: every such session of one process reads
        # the one copy this party keeps (a torchrun party's ranks hold shares).
        shared = method is not None and method.name == "lora" and ranks is None
        state = PartyState(
            cfg,
            partition,
            COMPUTE_PARTY,
            session.train,
            self.device,
            seeds=seeds,
            method=method,
            lora_seeds=lora_seeds,
            frozen=self.frozen_base(cfg) if shared else None,
        )
        folder = None
        if session.start_step:
            run = self.run_dir(session.run_id, session.tenant)
            assert run is not None  # negotiate() only resumes with a folder
            folder = ckpt.step_folder(run.checkpoints, session.start_step)
        place_weights(
            state,
            self.base,
            folder,
            fresh_train=session.purpose == "train",
            rank=0 if ranks is None else ranks.rank,
            world=1 if ranks is None else ranks.world,
        )
        if folder is not None:
            log.info("loaded %s", folder)
        elif self.base is not None and session.purpose == "train":
            log.info("initialised from %s", self.base.checkpoint)
        return state

    def save_share(self, rounds: Rounds, r: int, c: proto.Control) -> None:
        """A SAVE round on every rank of a pipelined party: each saves its
        share (``split.backbone.shards``); rank 0 makes the run folder first and
        answers A once all have saved."""
        ranks = self.ranks
        assert ranks is not None
        session, first = rounds.session, ranks.rank == 0
        run = self.run_dir(session.run_id, session.tenant)
        new_folder = run is not None and not run.path.exists()
        ok = run is not None
        if ok and first and not (run.path / "config.json").is_file():
            try:
                run.create(self.run_config(session), resume=False)
            except OSError as e:
                log.error("checkpoint of step %d failed: %s", c.step, e)
                ok = False
        ok = ranks.all_ok(ok)  # the folder is there before any rank writes
        # Every rank takes part (sharded weights are gathered); FSDP2-sharded:
        # rank 0 writes the whole.
        files = rounds.checkpoint_tensors() if ok else {}
        if ok and (first or not ranks.sharded):
            blocks = ranks.blocks[ranks.rank]
            state = {
                "party": COMPUTE_PARTY,
                "run_id": session.run_id,
                "model": rounds.state.cfg.to_dict(),
                "partition": self.partition.to_dict(),
                "train": proto.compute_party_train(session.train),
                "blocks": [blocks.start, blocks.stop],
            }
            if first and not ranks.sharded:
                state[shards.WORLD] = ranks.world
            try:
                ckpt.save(
                    shards.rank_root(run.checkpoints, ranks.rank),
                    c.step,
                    files,
                    state,
                    keep=self.keep,
                )
            except (OSError, ckpt.CheckpointError) as e:
                log.error(
                    "rank %d: checkpoint of step %d failed: %s", ranks.rank, c.step, e
                )
                ok = False
        if run is not None:
            ok = ranks.all_ok(ok)
        if not first:
            return
        if run is None:
            log.warning("asked to checkpoint step %d but serving without --out", c.step)
        elif not ok and new_folder:
            shutil.rmtree(run.path, ignore_errors=True)
        if ok:
            log.info("saved step %d on %d ranks", c.step, ranks.world)
        rounds.link.send_scalar("saved", float(c.step) if ok else -1.0, step=r)
