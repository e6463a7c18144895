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

import hmac
import logging
import shutil
import time
from dataclasses import KW_ONLY, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from aisyn.link.base import Link
from aisyn.link.errors import HandshakeError
from aisyn.link.memory import IN_PROCESS
from aisyn.model.causal_lm import masks_from_documents
from aisyn.model.families import ModelConfig, build_model, hf_folder, with_vocab
from aisyn.model.segments import (
    COMPUTE_PARTY,
    DATA_PARTY,
    Partition,
    PartitionError,
    StageCache,
    own_tensor_shapes,
)
from aisyn.split import protocol as proto
from aisyn.split import schedule
from aisyn.split.party import (
    PartyState,
    SkippedStep,
    base_label,
    open_base,
    place_weights,
)
from aisyn.train import checkpoint as ckpt
from aisyn.train.config import TrainConfig
from aisyn.train.device import autocast_for, resolve_device
from aisyn.train.lora import Method, lora_parameter_names
from aisyn.train.run import RunDir

log = logging.getLogger(__name__)


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
        self.own_parameters = partition.parameter_names(
            build_model(cfg, device="meta"), COMPUTE_PARTY
        )
        #: whether the vocabulary is this party's to fix: a base fixes it (its
        #: embedding, and the data party's fingerprint of it), and so do any
        #: tensors of B's that depend on it; otherwise each run takes the data
        #: party's, as ``aisyn train`` sizes a preset to the data's tokenizer
        self.vocab_fixed = init_from is not None or _vocab_shapes(
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

    def run_dir(self, run_id: str) -> RunDir | None:
        return None if self.root is None else RunDir(self.root / run_id)

    def negotiate(self, hello_text: str, identity: str) -> tuple[str, Session]:
        """Check A's hello; returns (reply JSON, session). ``identity`` is the
        data party as its link vouches for it (``PeerHello.identity``): a run
        is bound to the identity that created it. Raises HandshakeError with a
        one-line reason to refuse (B stays up either way)."""
        try:
            return self._negotiate(hello_text, identity)
        except (ValueError, TypeError, OSError) as e:  # ProtocolError: ValueError
            raise HandshakeError(f"compute party refused the session: {e}") from None

    def _negotiate(self, hello_text: str, identity: str) -> tuple[str, Session]:
        if not identity:
            # Nothing vouches for this peer: it could pass for any run's owner.
            raise proto.ProtocolError("the link does not identify the data party")
        h = proto.parse_hello(hello_text)
        run_id, purpose = h.run_id, h.purpose
        run = self.run_dir(run_id)
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
        b_steps = ckpt.complete_steps(run.checkpoints) if run is not None else []
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
            for name in (ckpt.MODEL_FILE, ckpt.OPTIM_FILE):
                if not (folder / name).is_file():
                    raise ckpt.CheckpointError(f"{folder / name}: missing")
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
        )

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
            # LoRA: B's checkpoints hold its adapters; its weights are the base's
            "lora": (
                None
                if session.lora is None
                else {"rank": session.lora[0].rank, "alpha": session.lora[0].alpha}
            ),
            "init_from": str(self.base.checkpoint) if self.base else None,
        }

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
        method, lora_seeds = session.lora or (None, None)
        state = PartyState(
            session.cfg or self.cfg,
            self.partition,
            COMPUTE_PARTY,
            session.train,
            self.device,
            seeds=session.seeds,
            method=method,
            lora_seeds=lora_seeds,
        )
        folder = None
        if session.start_step:
            run = self.run_dir(session.run_id)
            assert run is not None  # negotiate() only resumes with a folder
            folder = ckpt.step_folder(run.checkpoints, session.start_step)
        place_weights(state, self.base, folder, fresh_train=session.purpose == "train")
        if folder is not None:
            log.info("loaded %s", folder)
        elif self.base is not None and session.purpose == "train":
            log.info("initialised from %s", self.base.checkpoint)
        server = _Rounds(self, state, link, session, first_round_timeout_s)
        server.run()


#: the key of B's run config.json naming the data party the run is bound to
OWNER = "owner"
#: the largest vocabulary a data party may announce (B never allocates it)
MAX_VOCAB = 1 << 24


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


def _vocab_shapes(cfg: ModelConfig, partition: Partition, party: str) -> bool:
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
        with safe_open(str(file), framework="pt") as f:
            if name not in f.keys():
                return cfg
            shape = f.get_slice(name).get_shape()
    except (SafetensorError, OSError):
        return cfg
    if len(shape) != len(two[name]) or shape[dim] == cfg.vocab_size:
        return cfg
    log.info(
        "vocabulary %d, the base's (the model config says %d)",
        shape[dim],
        cfg.vocab_size,
    )
    return with_vocab(cfg, shape[dim])


class _Rounds:
    """B's side of the rounds of one session."""

    def __init__(
        self,
        party: ComputeParty,
        state: PartyState,
        link: Link,
        session: Session,
        first_round_timeout_s: float | None = None,
    ) -> None:
        self.party = party
        self.first_round_timeout_s = first_round_timeout_s
        self.state = state
        self.link = link
        self.session = session
        (self.middle,) = state.segments
        self.next_step = session.start_step
        self.hidden = state.cfg.hidden_size
        #: the KV cache of B's blocks for the sequence being generated
        self.gen_cache: StageCache | None = None

    def run(self) -> None:
        try:
            self._rounds()
        finally:
            self.gen_cache = None  # a generation left open ends with the session

    def _rounds(self) -> None:
        from aisyn.link.errors import PeerClosedError, PeerLostError

        r = 0
        while True:
            try:
                t = self.link.recv(
                    "ctl",
                    step=r,
                    shape=(7,),
                    dtype=torch.int64,
                    # A hello and silence must not hold the server for long.
                    timeout=self.first_round_timeout_s if r == 0 else None,
                )
            except PeerClosedError:
                # A said goodbye between rounds: the normal end of a session.
                log.info(
                    "session for run %s ended: the data party closed it after "
                    "%d round(s)",
                    self.session.run_id,
                    r,
                )
                return
            except PeerLostError as e:
                # A went away between rounds: nothing is half done, but it did
                # not say goodbye, so say what happened.
                log.warning(
                    "session for run %s ended between rounds: %s",
                    self.session.run_id,
                    e,
                )
                return
            c = proto.Control.parse(t, self.state.cfg.seq_len)
            if c.op == proto.TRAIN:
                self._train(r, c)
            elif c.op == proto.EVAL:
                self._eval(r, c)
            elif c.op in proto.GEN_OPS:
                self._generate(r, c)
            else:
                self._save(r, c)
            r += 1

    def _recv_act(self, r: int, i: int, c: proto.Control) -> tuple[torch.Tensor, ...]:
        shape = (c.micro_size, c.seq_len, self.hidden)
        x = self.link.recv("act", step=r, micro=i, shape=shape, dtype=torch.float32)
        mask = None
        if c.eod:
            doc = self.link.recv(
                "doc",
                step=r,
                micro=i,
                shape=(c.micro_size, c.seq_len),
                dtype=torch.int32,
            )
            mask, _ = masks_from_documents(doc.to(self.state.device, torch.int64))
        return x.to(self.state.device), mask

    def _at_next_step(self, c: proto.Control, name: str) -> None:
        """A round that moves training on (TRAIN, SAVE) comes only in a
        training session, at the step this party is at; ``name``: the round
        as the messages call it."""
        if self.session.purpose != "train":
            raise proto.ProtocolError(
                f"{proto.OPS[c.op]} round in an evaluation session"
            )
        if c.step != self.next_step:
            raise proto.ProtocolError(
                f"{name} for step {c.step}, this party is at step {self.next_step}"
            )

    def _train(self, r: int, c: proto.Control) -> None:
        self._at_next_step(c, "TRAIN round")
        self.state.train(True)
        inflight: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        shape = (c.micro_size, c.seq_len, self.hidden)
        for kind, i in schedule.make(c.micro_batches, c.window).b:
            if kind == "F":
                x, mask = self._recv_act(r, i, c)
                self.state.checked(x, f"the activations (micro-batch {i})")
                x.requires_grad_()
                with self.state.autocast():  # as aisyn train
                    y = self.middle(x, mask)
                self.link.send("out", y, step=r, micro=i, codec=self.session.codec)
                inflight[i] = (x, y)
            else:
                g = self.link.recv(
                    "gout", step=r, micro=i, shape=shape, dtype=torch.float32
                )
                self.state.checked(g, f"the gradient of the output (micro-batch {i})")
                x, y = inflight.pop(i)
                torch.autograd.backward(y, g.to(self.state.device))
                self.link.send(
                    "gact", x.grad, step=r, micro=i, codec=self.session.codec
                )
        mine = self.state.local_sq_norm()  # NaN: this party skips the step
        self.link.send_scalar("sqnorm", mine, step=r)
        theirs = self.link.recv_scalar("sqnorm", step=r)
        try:
            self.state.apply_step(c.step, theirs, mine)
        except SkippedStep as e:
            # The data party takes the same decision from the same two numbers;
            # B stays at this step, and the session goes on if A wants it to.
            log.warning("run %s: %s", self.session.run_id, e)
            return
        self.next_step = c.step + 1

    @torch.no_grad()
    def _eval(self, r: int, c: proto.Control) -> None:
        self.state.train(False)
        x, mask = self._recv_act(r, 0, c)
        with autocast_for(self.state.device):
            y = self.middle(x, mask)
        self.link.send("out", y, step=r, codec=self.session.codec)

    @torch.no_grad()
    def _generate(self, r: int, c: proto.Control) -> None:
        """One generation round: open the cache, run the next positions through
        it, or free it. Tokens never arrive, only the front's hidden states."""
        if self.session.purpose != "generate":
            raise proto.ProtocolError(
                f"{proto.OPS[c.op]} round in a {self.session.purpose} session"
            )
        if c.op == proto.GEN_START:
            if self.gen_cache is not None:
                raise proto.ProtocolError(
                    "GEN_START while a generation is open (end it first)"
                )
            self.state.train(False)
            self.gen_cache = self.middle.new_cache(c.seq_len)
            return
        cache = self.gen_cache
        if cache is None:
            raise proto.ProtocolError(f"{proto.OPS[c.op]} with no generation open")
        if c.op == proto.GEN_END:
            self.gen_cache = None  # the keys and values go with it
            return
        first, count = c.step, c.seq_len
        if first != cache.length or first + count > cache.capacity:
            raise proto.ProtocolError(
                f"GEN_STEP for positions [{first}, {first + count}): the cache "
                f"holds {cache.length} of {cache.capacity}"
            )
        x = self.link.recv(
            "act", step=r, shape=(1, count, self.hidden), dtype=torch.float32
        )
        if not bool(torch.isfinite(x).all()):
            # Nothing to skip as in training: a bad position would poison every
            # later one through the cache, so the session ends.
            raise proto.ProtocolError(
                f"non-finite activations for positions [{first}, {first + count})"
            )
        # fp32 on every device, as the data party and ``aisyn generate`` run
        y = self.middle(x.to(self.state.device), cache=cache)
        self.link.send("out", y, step=r, codec=self.session.codec)

    def _save(self, r: int, c: proto.Control) -> None:
        self._at_next_step(c, "SAVE")
        run = self.party.run_dir(self.session.run_id)
        if run is None:
            log.warning("asked to checkpoint step %d but serving without --out", c.step)
            self.link.send_scalar("saved", -1.0, step=r)
            return
        t0 = time.perf_counter()
        # A run's first save makes its folder; if that save fails, no folder
        # is left to pass for a run (nor for one bound to this data party).
        new_folder = not run.path.exists()
        try:
            if not (run.path / "config.json").is_file():
                run.create(self.party.run_config(self.session), resume=False)
            folder = ckpt.save(
                run.checkpoints,
                c.step,
                self.state.tensors(),
                {
                    "party": COMPUTE_PARTY,
                    "run_id": self.session.run_id,
                    "model": self.state.cfg.to_dict(),
                    "partition": self.party.partition.to_dict(),
                    "train": proto.compute_party_train(self.session.train),
                },
                keep=self.party.keep,
            )
        except (OSError, ckpt.CheckpointError) as e:
            log.error("checkpoint of step %d failed: %s", c.step, e)
            if new_folder:
                shutil.rmtree(run.path, ignore_errors=True)
            self.link.send_scalar("saved", -1.0, step=r)
            return
        log.info("saved %s (%.2f s)", folder, time.perf_counter() - t0)
        self.link.send_scalar("saved", float(c.step), step=r)
