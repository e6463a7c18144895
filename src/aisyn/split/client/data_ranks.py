"""Party A over the ranks of a torchrun job: its blocks FSDP2-sharded, each
micro-batch's rows shared.

``torchrun --nproc-per-node R -m aisyn.cli split train ...`` runs the data
party on R ranks (devices). Rank 0 is the data party as one process runs it:
the run folder, the data, the loss, the engine and the one link to B. Ranks
1..R-1 hold no data and no folder of their own; they follow rank 0's words
over the job's control group (``follow``): start, load, train a step,
evaluate a batch, save, end.

Within a step every rank runs A's schedule (``split.schedule``) on its share
of each micro-batch's rows (``torch.tensor_split``): rank 0 hands out the
tokens and targets, gathers the front's output rows into the one activation
tensor B receives, hands out B's answer, and so on for every tensor that
crosses. B sees exactly what a one-process data party sends: the same
tensors, the same rounds, one link (its side does not change and cannot
tell). A's blocks are sharded with FSDP2 (``split.sharding.shard_blocks``:
each rank keeps 1/R of every block's weights, gradients and AdamW moments,
gathering a block's weights only to run it), so a data party with more
devices can hold a bigger front and back. The embedding, final norm and head
stay whole on every rank (a tied head shares its weight with the embedding,
which FSDP2 cannot put in two groups; Megatron-LM keeps them replicated the
same way), and their gradients are summed once a step with an all-reduce.

The step's loss is a sum over rows (``train.objective.RowsLoss``), so the
ranks' gradients and losses sum to a single process's, to float rounding.
A cut defence is applied as one process applies it: each rank clips its rows
and adds its rows of the noise drawn for the whole micro-batch. Gradient
clipping uses the global norm: the ranks' shares of A's squared norm are
summed, and rank 0 exchanges the sum with B.

Failures: a rank that dies ends the others' waits within seconds (gloo sees
the closed connection) and the job ends with one line; rank 0's session
with B ends with it and B keeps serving. Only rank 0 writes checkpoints, so
the last one stays loadable; the job resumes with ``--resume`` on any number
of ranks.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from aisyn.errors import RunFailedError
from aisyn.model.causal_lm import document_index, eod_reset_masks
from aisyn.model.families import config_from_dict
from aisyn.model.segments import DATA_PARTY, Partition
from aisyn.split import protocol as proto
from aisyn.split.client.data_party import DataSession
from aisyn.split.client.executor import SplitExecutor
from aisyn.split.defence import cut_dp as dp
from aisyn.split.party import PartyState, open_base, place_weights
from aisyn.split.sharding import (
    IDLE_WAIT,
    RankGroup,
    check_gpus,
    gather_rows,
    gathered_tensors,
    is_sharded,
    row_shares,
    scatter_rows,
    shard_blocks,
    shard_sq_norm,
)
from aisyn.train.config import TrainConfig
from aisyn.train.device import autocast_for
from aisyn.train.lora import Method
from aisyn.train.objective import RowsLoss, StepBatch
from aisyn.train.run import RunDir
from aisyn.train.update import SkippedStep

log = logging.getLogger(__name__)


class DataRanksFailed(RunFailedError):
    """A rank of the data party stopped, or fell out of step, mid-command."""


class DataRanks(RankGroup):
    """The torchrun job a data party runs as."""

    #: rank 0 told the others a command they have not finished: a failure
    #: now leaves them mid-collective (they end with rank 0's process)
    busy = False

    @classmethod
    def join(
        cls, device: torch.device, timeout_s: float | None
    ) -> tuple[DataRanks, torch.device]:
        """Join the job torchrun describes; this rank's device. Collectives
        within a command time out after ``timeout_s`` (None: the idle wait),
        the wait for rank 0's next word never."""
        from aisyn.train import distributed

        world = distributed.world_size()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        check_gpus(device, local)
        timeout = IDLE_WAIT if timeout_s is None else timedelta(seconds=timeout_s)
        ctx, device = distributed.setup(device, timeout)
        ctl = dist.new_group(backend="gloo", timeout=IDLE_WAIT)
        return cls(ctx.rank, world, ctl), device

    def problem_with(self, micro_size: int, method: Method) -> str | None:
        """Why the data party cannot train on these ranks (one line)."""
        if micro_size < self.world:
            return (
                f"the data party shares each micro-batch's rows over its "
                f"{self.world} ranks, and micro-batches of {micro_size} row(s) "
                f"would leave ranks idle: use --micro-batch-size of at least "
                f"{self.world}, or start it on at most {micro_size} ranks"
            )
        if method.name != "full":
            return (
                f"--method {method.name} on a data party of {self.world} ranks "
                "is not supported (its blocks are FSDP2-sharded for full "
                "training); run LoRA on one process"
            )
        return None

    def tell(self, do: str, **fields) -> None:
        """Rank 0's next word to the other ranks."""
        self.broadcast_json({"do": do, **fields})
        self.busy = do not in ("start", "end")


@contextmanager
def in_step(ranks: RankGroup, what: str):
    """A command every rank runs: a failure in it (a rank gone, a collective
    timed out) ends the job with one line naming it; a skipped step is no
    failure (every rank skips it alike)."""
    try:
        yield
        ranks.busy = False
    except SkippedStep:
        ranks.busy = False
        raise
    except RuntimeError as e:  # what torch.distributed raises (and its bugs)
        if isinstance(e, RunFailedError):
            raise
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataRanksFailed(
            f"the data party's ranks fell out of step in {what} (rank "
            f"{ranks.rank} of {ranks.world}): {first}; the last checkpoint "
            "is intact (resume with --resume)"
        ) from e


class RankedDataSession(DataSession):
    """A's end of a session on every rank of a data party's job. On rank 0
    it holds the link and is driven by the engine; on the others ``link`` is
    None and ``follow`` drives it. Every tensor that crosses to B is
    gathered from the ranks' rows on rank 0, every one from B handed out."""

    def __init__(self, state, link, ranks: DataRanks, **kw) -> None:
        super().__init__(state, link, **kw)
        self.ranks = ranks
        self.sharded: list = []  # FSDP2's modules, once the weights are in
        self._rows = 0  # the current micro-batch's rows (all ranks')
        self._inputs: list[torch.Tensor] = []  # rank 0: each micro-batch's

    # --- weights -------------------------------------------------------------

    def place(self, base, folder: Path | None) -> dict | None:
        """Every rank: the weights of ``folder`` (None: a fresh start), then
        the blocks sharded over the ranks (once)."""
        state = place_weights(self.state, base, folder, fresh_train=True)
        if not self.sharded:
            blocks = [
                i
                for st in self.state.partition.stages_of(DATA_PARTY)
                for i in st.blocks
            ]
            self.sharded = shard_blocks(self.state, self.ranks.world, blocks)
        return state

    # --- a training step -------------------------------------------------------

    def train_step(self, batch: StepBatch, step: int) -> dict:
        """Rank 0: tell the other ranks, hand out the rows, run the step."""
        if batch.rows_loss is None:
            raise ValueError(
                "this objective's loss does not split by rows (micro-batches "
                "of unequal sizes?); train it on one process"
            )
        mb, T = batch.micro[0][0].shape
        self.ranks.tell(
            "train",
            step=step,
            micro=len(batch.micro),
            rows=mb,
            seq=T,
            loss=batch.rows_loss.to_dict(),
        )
        self._inputs = [m[0] for m in batch.micro]
        return self._train(step, len(batch.micro), mb, T, batch.rows_loss, batch.micro)

    def follow_train(self, word: dict) -> None:
        loss = RowsLoss.from_dict(word["loss"])
        step, m = int(word["step"]), int(word["micro"])
        torch.manual_seed(_rank_seed(self.state.train_cfg.seed, step, self.ranks.rank))
        try:
            self._train(step, m, int(word["rows"]), int(word["seq"]), loss, None)
        except SkippedStep:
            pass  # rank 0 reports it

    def _train(self, step, m, mb, T, loss, micro) -> dict:
        with in_step(self.ranks, f"step {step + 1}"):
            self._rows = mb
            mine = []
            for i in range(m):
                inputs, targets = (None, None) if micro is None else micro[i][:2]
                rows = self._scatter(inputs, (mb, T), torch.int64)
                rows_t = self._scatter(targets, (mb, T), torch.int64)
                mask = pos = None
                if self.eod_id is not None:
                    mask, pos = eod_reset_masks(rows, self.eod_id)
                mine.append((rows, rows_t, mask, pos))
            return self.train_micro_batches(mine, step, loss)

    # --- the hooks of ``DataSession.train_micro_batches`` -----------------------

    def _open_round(self, control: proto.Control) -> int:
        if self.ranks.rank == 0:
            return super()._open_round(control)
        self.round += 1
        return self.round - 1

    def _micro_size(self, micro) -> int:
        return self._rows

    def _scatter(self, t, shape, dtype) -> torch.Tensor:
        return scatter_rows(self.ranks, t, shape, dtype, self.state.device)

    def _padded(self, fn, h: torch.Tensor, *where: object) -> torch.Tensor:
        """``fn`` (a defence of the whole micro-batch: row-wise clipping,
        noise drawn for every row) on this rank's rows ``h``."""
        share = row_shares(self._rows, self.ranks.world)[self.ranks.rank]
        before = h.new_zeros((share.start, *h.shape[1:]))
        after = h.new_zeros((self._rows - share.stop, *h.shape[1:]))
        return fn(torch.cat([before, h, after]), *where)[share.start : share.stop]

    def _protect(self, h: torch.Tensor, *where: object) -> torch.Tensor:
        if self.guard is None:
            return h
        return self._padded(self.guard.activations, h, *where)

    def _protect_gradient(self, g: torch.Tensor, *where: object) -> torch.Tensor:
        return self._padded(self.guard.gradient, g, *where)

    def _send_act(self, r: int, i: int, h: torch.Tensor, inputs) -> None:
        whole = gather_rows(self.ranks, h, (self._rows, *h.shape[1:]))
        if whole is not None:
            super()._send_act(r, i, whole.to(h.dtype), self._inputs[i])

    def _recv(self, tag: str, r: int, i: int, shape, what: str) -> torch.Tensor:
        t = super()._recv(tag, r, i, shape, what) if self.ranks.rank == 0 else None
        return self._scatter(t, shape, torch.float32)

    def _send(self, tag: str, r: int, i: int, t: torch.Tensor) -> None:
        whole = gather_rows(self.ranks, t, (self._rows, *t.shape[1:]))
        if whole is not None:
            super()._send(tag, r, i, whole)

    def _step_losses(self, losses: list[float]) -> list[float]:
        return self.ranks.sum_floats(losses)

    def _sq_norm(self) -> float:
        """A's squared gradient norm, on every rank, once the whole gradients
        (embedding, norm, head) are summed over the ranks: the shards' squares
        of every rank, the whole ones' once; NaN if a rank found a problem."""
        whole = [
            p.grad
            for p in self.state.params
            if p.grad is not None and not is_sharded(p)
        ]
        if whole:
            flat = torch.cat([g.reshape(-1) for g in whole])
            dist.all_reduce(flat)
            at = 0
            for g in whole:
                g.copy_(flat[at : at + g.numel()].view_as(g))
                at += g.numel()
        local = shard_sq_norm(self.state.params, replicated=self.ranks.rank == 0)
        if self.state.problem is not None:
            local = float("nan")
        return self.ranks.sum_float(local)

    def _exchange_norms(self, r: int, mine: float) -> float:
        theirs = super()._exchange_norms(r, mine) if self.ranks.rank == 0 else 0.0
        return self.ranks.broadcast_float(theirs)

    # --- evaluation -------------------------------------------------------------

    @torch.no_grad()
    def hidden(self, tokens, attn_mask=None, position_ids=None) -> torch.Tensor:
        """Rank 0: one EVAL round with the rows run on every rank."""
        if attn_mask is not None and self.eod_id is None:
            return super().hidden(tokens, attn_mask, position_ids)  # its refusal
        B, T = tokens.shape
        self.ranks.tell(
            "eval",
            rows=B,
            seq=T,
            mask=None if attn_mask is None else list(attn_mask.shape),
            pos=position_ids is not None,
        )
        flags = proto.FLAG_EOD if attn_mask is not None else 0
        r = self._open_round(proto.Control(proto.EVAL, 0, 1, B, T, 0, flags))
        return self._eval(r, B, T, tokens, attn_mask, position_ids)

    @torch.no_grad()
    def follow_eval(self, word: dict) -> None:
        r = self._open_round(None)
        mask = word["mask"]
        self._eval(
            r,
            int(word["rows"]),
            int(word["seq"]),
            None,
            mask,
            bool(word["pos"]),
        )

    def _eval(self, r, B, T, tokens, mask, pos) -> torch.Tensor | None:
        """Rank 0 passes its tensors; the others, in ``mask`` the mask's
        shape (or None) and in ``pos`` whether there are position ids."""
        lead = self.ranks.rank == 0
        dev = self.state.device
        with in_step(self.ranks, "an evaluation"):
            self._rows = B
            x = self._scatter(tokens, (B, T), torch.int64)
            m = p = None
            if mask is not None:
                shape = list(mask.shape) if lead else mask
                m = self._scatter(
                    mask.to(torch.uint8) if lead else None, shape, torch.uint8
                ).bool()
            if (pos is not None) if lead else pos:
                p = self._scatter(pos if lead else None, (B, T), torch.int64)
            self.evals_since_step += 1
            with autocast_for(dev):
                clean = self.front(x, m, p)
                sent = self._protect(
                    clean, "eval", self.last_step, self.evals_since_step
                )
            whole = gather_rows(self.ranks, sent, (B, T, self.hidden_size))
            y = None
            if lead:
                self.link.send("act", whole.to(sent.dtype), step=r)
                if m is not None:
                    doc = document_index(tokens, self.eod_id).to(torch.int32)
                    self.link.send("doc", doc, step=r)
                y = self._recv_hidden(r, B, T, f"in evaluation round {r}")
            y = self._scatter(y, (B, T, self.hidden_size), torch.float32)
            with autocast_for(dev):
                h = self.back(self._restore(y, clean, sent), m, p)
            out = gather_rows(self.ranks, h, (B, T, self.hidden_size))
        return None if out is None else out.to(h.dtype)


def _rank_seed(seed: int, step: int, rank: int) -> int:
    """The seed of rank ``rank``'s generator in step ``step`` (its dropout),
    so a resumed run draws what the uninterrupted one drew."""
    key = f"{seed}:{step}:{rank}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


class RankedSplitExecutor(SplitExecutor):
    """Rank 0's executor: saving and loading with every rank."""

    @property
    def ranks(self) -> DataRanks:
        return self.session.ranks

    def save(self, run: RunDir, step: int, state: dict, keep: int) -> None:
        self.session.save_remote(step)  # B's half first: pairs stay consistent
        self.ranks.tell("save")
        with in_step(self.ranks, f"the checkpoint of step {step}"):
            tensors = gathered_tensors(self.state)
        self._write(run, step, state, keep, tensors)

    def load(self, folder: Path | None) -> dict | None:
        self.ranks.tell("load", folder=None if folder is None else str(folder))
        with in_step(self.ranks, "loading the weights"):
            return self.session.place(self.base, folder)


def start_words(
    ranks: DataRanks,
    state: PartyState,
    *,
    eod_id: int | None,
    window: int,
    defence: dp.CutDefence,
    init_from: str | None,
) -> None:
    """Rank 0: what the other ranks need to build A's half as it does."""
    ranks.tell(
        "start",
        model=state.cfg.to_dict(),
        partition=state.partition.to_dict(),
        train=state.train_cfg.to_dict(),
        method=state.method.to_dict(),
        eod_id=eod_id,
        window=window,
        defence=defence.to_dict(),
        init_from=init_from,
    )


def end_words(ranks: DataRanks, error: BaseException | None = None) -> None:
    """Rank 0, between commands: the other ranks end too. After ``error``,
    a rank already gone is no news (rank 0 reports ``error`` itself)."""
    why = None if error is None else (str(error).splitlines() or [repr(error)])[0]
    try:
        ranks.tell("end", error=why)
    except RuntimeError:
        if error is None:
            raise


def follow(ranks: DataRanks, device: torch.device) -> None:
    """What every rank but 0 of a data party does: rank 0's words, until the
    end. Its own failures end it with one line."""
    try:
        _follow(ranks, device)
    except DataRanksFailed:
        raise
    except RuntimeError as e:  # rank 0 gone mid-collective
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataRanksFailed(
            f"rank {ranks.rank} of the data party lost rank 0 ({first}); see "
            "rank 0's output for why"
        ) from e


def _follow(ranks: DataRanks, device: torch.device) -> None:
    word = ranks.broadcast_json()
    if word.get("do") != "start":
        return
    cfg = config_from_dict(word["model"])
    partition = Partition.from_dict(word["partition"], cfg.layout)
    train = TrainConfig.from_dict(word["train"])
    method = Method.from_dict(word["method"])
    state = PartyState(cfg, partition, DATA_PARTY, train, device, method=method)
    defence = dp.CutDefence.from_dict(word["defence"])
    guard = dp.CutGuard(defence, train.seed) if defence.active else None
    base = None
    if word["init_from"]:
        base = open_base(word["init_from"], cfg, partition, DATA_PARTY)
    window = int(word["window"])
    session = RankedDataSession(
        state, None, ranks, eod_id=word["eod_id"], window=window, guard=guard
    )
    while True:
        word = ranks.broadcast_json()
        do = word.get("do")
        if do == "load":
            folder = word["folder"]
            with in_step(ranks, "loading the weights"):
                session.place(base, None if folder is None else Path(folder))
        elif do == "train":
            session.follow_train(word)
        elif do == "eval":
            session.follow_eval(word)
        elif do == "save":
            with in_step(ranks, "a checkpoint"):
                gathered_tensors(state)
        else:
            if word.get("error"):
                print(
                    f"aisyn: rank {ranks.rank} of the data party ends with rank 0: "
                    f"{word['error']}",
                    file=sys.stderr,
                )
            return
