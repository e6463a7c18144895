"""Party A, the data party: embedding + front blocks, back blocks + head + loss.

A drives every session: it sends a control tensor per round and runs its side
of the schedule (``schedule.py``). Tokens, labels and the loss stay here; so
do the prompt, the tokens and the logits of generation (``SplitDecoder``).

Exactness: each cut is a detached leaf on the receiving side; a segment's
backward runs once with the gradient received for its output
(``torch.autograd.backward(output, grad)``), so no forward is ever recomputed
and every parameter gets the gradient of the unsplit model. The loss is
accumulated exactly as ``train.executor.LocalExecutor`` does. Under a cut
defence (``split.defence.cut_dp``) the model computed is the defended one:
B's blocks see the noised activations and gradient, A's residual stream
stays clean
(``DataSession._restore``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from aisyn.link.base import Link
from aisyn.model.causal_lm import document_index
from aisyn.split import protocol as proto
from aisyn.split import schedule
from aisyn.split.defence.cut_dp import CutGuard
from aisyn.split.party import PartyState
from aisyn.train.device import autocast_for
from aisyn.train.objective import LossOf, MicroBatch, StepBatch


class SplitError(OSError):
    """The compute party could not do what the data party asked (e.g. write a
    checkpoint); an environment problem on its side, reported in one line."""


class DataSession:
    """A's end of one session: rounds of training, evaluation and saving."""

    def __init__(
        self,
        state: PartyState,
        link: Link,
        *,
        eod_id: int | None,
        window: int = 0,
        guard: CutGuard | None = None,
        frozen_backbone: bool = False,
        emulator: nn.Module | None = None,
    ) -> None:
        """``frozen_backbone``: B runs its blocks forward only and no gradient
        crosses (``split.defence.emulator``); A's front then learns through
        ``emulator`` (A's stand-in for B's middle), or not at all (None)."""
        if emulator is not None and not frozen_backbone:
            raise ValueError("an emulator stands in for a frozen backbone only")
        self.state = state
        self.link = link
        self.eod_id = eod_id
        self.window = window
        self.guard = guard  # the defence on what A sends (split.defence.cut_dp), if any
        self.frozen_backbone = frozen_backbone
        self.emulator = emulator
        self.front, self.back = state.segments
        self.hidden_size = state.cfg.hidden_size
        self.round = 0
        # Where the noise of an evaluation round comes from: the last training
        # step and the evaluations since, so a resumed run draws the same
        # noise and no two rounds share it.
        self.last_step: int | None = None
        self.evals_since_step = 0

    def _protect(self, h: torch.Tensor, *where: object) -> torch.Tensor:
        return h if self.guard is None else self.guard.activations(h, *where)

    def _protect_training(
        self, h: torch.Tensor, *where: object
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(what is sent for ``h``, A's training terms of the mechanism: a
        trained bottleneck's, scaled to its share of the step, or none)."""
        if self.guard is None or self.guard.bottleneck is None:
            return self._protect(h, *where), []
        sent, term = self.guard.defend(h, *where)
        return sent, [term / self._micro_count]

    @staticmethod
    def _restore(y: torch.Tensor, clean: torch.Tensor, sent: torch.Tensor):
        """B's output with A's own residual stream put back.

        B's middle is residual blocks, so its answer is ``sent + Δ(sent)``.
        Under a forward defence ``sent`` is the clipped, noised ``clean``;
        A, which knows both, returns to ``clean + Δ(sent)``: the noise then
        degrades only what B's blocks add, not the residual stream every
        later layer reads (without this, forward noise that hides the tokens
        costs nats; see docs/privacy.md). What B sees is unchanged.
        """
        if sent is clean:
            return y
        return y + (clean - sent).detach().to(y.dtype)

    def _open_round(self, control: proto.Control) -> int:
        r = self.round
        self.round += 1
        self.link.send("ctl", control.tensor(), step=r)
        return r

    def _send_act(self, r: int, i: int, h: torch.Tensor, inputs: torch.Tensor) -> None:
        self.link.send("act", h, step=r, micro=i)
        if self.eod_id is not None:
            # B applies the EOD reset from document indices, never tokens.
            doc = document_index(inputs, self.eod_id).to(torch.int32)
            self.link.send("doc", doc, step=r, micro=i)

    def train_step(self, batch: StepBatch, step: int) -> dict:
        """One optimizer step over ``batch`` (``train_micro_batches``)."""
        return self.train_micro_batches(batch.micro, step, batch.loss_of)

    def train_micro_batches(
        self, micro: Sequence[MicroBatch], step: int, loss_of: LossOf
    ) -> dict:
        """One optimizer step over ``micro`` (every micro-batch of one shape
        (mb, T): T may differ from step to step, the control tells B), with
        the loss ``loss_of(head, hidden, targets)`` computed here at A; the
        step's loss is the sum of the micro-batches' losses.

        The one split step of every objective (``train.objective``):
        pre-training and fine-tuning differ only in their micro-batches and
        ``loss_of``. What crosses to B goes through the ``_send`` / ``_recv``
        hooks, which a data party over several ranks
        (``split.client.data_ranks``) routes through its rank 0.
        """
        cfg = self.state.train_cfg
        mb, T = self._micro_size(micro), micro[0][0].shape[1]
        flags = proto.FLAG_EOD if self.eod_id is not None else 0
        r = self._open_round(
            proto.Control(proto.TRAIN, step, len(micro), mb, T, self.window, flags)
        )
        self.state.train(True)
        shape = (mb, T, self.hidden_size)
        losses = self._micro_batches(micro, r, step, shape, loss_of)
        total = 0.0
        for loss in self._step_losses([losses[i] for i in range(len(micro))]):
            total += loss  # the baseline's summation order
        if not math.isfinite(total) and self.state.problem is None:
            self.state.problem = f"non-finite loss ({total}) (lower --lr?)"
        mine = self._sq_norm()  # NaN: this party skips the step
        if self.frozen_backbone:
            # B trains nothing and needs no norm: only whether to skip (a
            # gradient norm would be a number about A's labels crossing).
            theirs = self._exchange_norms(r, 0.0 if math.isfinite(mine) else math.nan)
            if theirs != 0.0 and math.isfinite(mine):
                mine = math.nan  # B found a problem (NaN) or sent nonsense
                self.state.problem = self.state.problem or (
                    f"the compute party sent {theirs!r} for its norm (0 or NaN)"
                )
        else:
            theirs = self._exchange_norms(r, mine)
        self.last_step, self.evals_since_step = step, 0
        norm = self.state.apply_step(step, mine, theirs)  # or raises SkippedStep
        return {"loss": total, "lr": cfg.lr_at(step), "grad_norm": norm}

    def _micro_batches(self, micro, r: int, step: int, shape, loss_of) -> dict:
        """A step's micro-batches in A's order: activations out, B's output
        back; with B training, A's gradient for that output out and the cut's
        gradient back. With B frozen nothing else crosses: the loss is
        computed on B's real output, so the back blocks and the head get
        their exact gradient; the front's comes back through the emulator at
        the activations sent (``_front_backward``), or the front is frozen
        (its forward keeps no graph)."""
        frozen = self.frozen_backbone
        learns = not frozen or self.emulator is not None  # the front has a gradient
        # micro-batch -> (the front's output, what was sent in its place)
        fronts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        terms: dict[int, list[torch.Tensor]] = {}  # the mechanism's, if any
        # micro-batch -> A's gradient for B's output (B training under a
        # defence: with what was sent instead)
        gouts: dict[int, torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = {}
        losses: dict[int, float] = {}
        cfg, device = self.state.train_cfg, self.state.device
        self._micro_count = len(micro)
        for kind, i in schedule.make(len(micro), self.window).a:
            inputs, targets, mask, pos = micro[i]
            if kind == "F":
                with torch.set_grad_enabled(learns):
                    with autocast_for(device, cfg.autocast):  # as aisyn train
                        clean = self.front(inputs, mask, pos)
                        sent, terms[i] = self._protect_training(clean, step, i)
                self._send_act(r, i, sent.detach(), inputs)
                fronts[i] = clean, sent
            elif kind == "L":
                what = f"the backbone output (micro-batch {i})"
                y = self._recv("out", r, i, shape, what).requires_grad_(learns)
                clean, sent = fronts[i]
                with autocast_for(device, cfg.autocast):
                    hidden = self.back(self._restore(y, clean, sent), mask, pos)
                    loss = loss_of(self.back.logits, hidden, targets)
                loss.backward()
                if not frozen:
                    g = y.grad
                    if self.guard is not None:
                        gouts[i] = g, self._protect_gradient(g, step, i)
                        g = gouts[i][1]
                    self._send("gout", r, i, g)
                elif learns:
                    gouts[i] = y.grad
                losses[i] = loss.item()
            elif frozen:
                clean, sent = fronts.pop(i)
                term = terms.pop(i)
                if learns:
                    self._front_backward(clean, sent, gouts.pop(i), mask, pos, term)
            else:
                what = f"the gradient of the cut (micro-batch {i})"
                g = self._recv("gact", r, i, shape, what)
                clean, sent = fronts.pop(i)
                if self.guard is None:
                    torch.autograd.backward(sent, g)
                else:
                    # B's answer is the gradient through ``sent + Δ(sent)`` for
                    # the gradient it was sent; A's residual stream (clean, see
                    # ``_restore``) takes A's own, noiseless one instead.
                    true, noisy = gouts.pop(i)
                    term = terms.pop(i)
                    torch.autograd.backward(
                        (sent, clean, *term),
                        (g - noisy, true, *(torch.ones_like(t) for t in term)),
                    )
        return losses

    def _front_backward(self, clean, sent, g, mask, pos, term=()) -> None:
        """The front's gradient through the emulator ``E`` for the gradient
        ``g`` of B's output: the residual stream (``_restore``: A's own
        ``clean``) takes ``g`` itself, what the middle adds (``E(sent) -
        sent``) takes it through ``E``'s Jacobian. Without a defence (``sent
        is clean``) this is ``J_E(clean)^T g``. ``term``: the mechanism's
        training terms, if any (a trained bottleneck's)."""
        with autocast_for(self.state.device, self.state.train_cfg.autocast):
            added = self.emulator(sent, mask, pos) - sent
        torch.autograd.backward(
            (added, clean, *term),
            (g.to(added.dtype), g, *(torch.ones_like(t) for t in term)),
        )

    # --- what crosses, and what the step sums (one process: all of it here)

    def _micro_size(self, micro: Sequence[MicroBatch]) -> int:
        return micro[0][0].shape[0]

    def _protect_gradient(self, g: torch.Tensor, *where: object) -> torch.Tensor:
        return self.guard.gradient(g, *where)

    def _recv(self, tag: str, r: int, i: int, shape, what: str) -> torch.Tensor:
        """B's ``tag`` tensor of micro-batch ``i``, noted if not finite."""
        t = self.link.recv(tag, step=r, micro=i, shape=shape, dtype=torch.float32)
        return self.state.checked(t, what).to(self.state.device)

    def _send(self, tag: str, r: int, i: int, t: torch.Tensor) -> None:
        self.link.send(tag, t, step=r, micro=i)

    def _step_losses(self, losses: list[float]) -> list[float]:
        """The micro-batches' losses of the step (here: this process's)."""
        return losses

    def _sq_norm(self) -> float:
        return self.state.local_sq_norm()

    def _exchange_norms(self, r: int, mine: float) -> float:
        self.link.send_scalar("sqnorm", mine, step=r)
        return self.link.recv_scalar("sqnorm", step=r)

    @torch.no_grad()
    def hidden(
        self,
        tokens: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states through the link (one EVAL round)."""
        if attn_mask is not None and self.eod_id is None:
            raise ValueError(
                "a split model applies only the EOD-reset mask of its run; this run "
                "was trained without --eod-reset"
            )
        eod = attn_mask is not None
        B, T = tokens.shape
        flags = proto.FLAG_EOD if eod else 0
        r = self._open_round(proto.Control(proto.EVAL, 0, 1, B, T, 0, flags))
        device = self.state.device
        self.evals_since_step += 1
        with autocast_for(device):
            clean = self.front(tokens, attn_mask, position_ids)
            sent = self._protect(clean, "eval", self.last_step, self.evals_since_step)
        self.link.send("act", sent, step=r)
        if eod:
            doc = document_index(tokens, self.eod_id).to(torch.int32)
            self.link.send("doc", doc, step=r)
        y = self._recv_hidden(r, B, T, f"in evaluation round {r}")
        with autocast_for(device):
            y = self._restore(y.to(device), clean, sent)
            return self.back(y, attn_mask, position_ids)

    def _recv_hidden(self, r: int, B: int, T: int, where: str) -> torch.Tensor:
        """B's ``(B, T, hidden)`` answer of round ``r``; non-finite values are
        reported ``where`` they came."""
        y = self.link.recv(
            "out", step=r, shape=(B, T, self.hidden_size), dtype=torch.float32
        )
        if not bool(torch.isfinite(y).all()):
            raise FloatingPointError(
                f"the compute party returned non-finite hidden states {where}"
            )
        return y

    # --- generation ---------------------------------------------------------

    def decoder(self, capacity: int) -> SplitDecoder:
        """A ``StepDecoder`` for one sequence of up to ``capacity`` positions."""
        return SplitDecoder(self, capacity)

    def save_remote(self, step: int) -> None:
        """Ask B to checkpoint ``step``; returns once it is on B's disk."""
        r = self._open_round(proto.Control(proto.SAVE, step))
        saved = self.link.recv_scalar("saved", step=r)
        if saved != float(step):
            raise SplitError(
                f"the compute party could not checkpoint step {step} (see its log); "
                "the data party's checkpoint was not written either"
            )


class SplitModel(nn.Module):
    """A's view of the whole model, for evaluation: ``forward`` / ``hidden`` /
    ``logits`` like ``CausalLM``, with the middle computed by B.

    ``evaluate_loss`` and ``cloze_accuracy`` run on it unchanged; tokens never
    leave A.
    """

    def __init__(self, session: DataSession) -> None:
        super().__init__()
        self.session = session
        self.inner = session.state.model  # A's partly materialised model
        self.config = self.inner.config

    def hidden(self, *args) -> torch.Tensor:
        """(tokens, attn_mask, position_ids), as ``DataSession.hidden``."""
        return self.session.hidden(*args)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.logits(x)

    def forward(self, *args) -> torch.Tensor:
        return self.logits(self.hidden(*args))


class SplitDecoder:
    """``model.generate.Decoder`` for a split model: the logits of the next
    token, one step at a time, with the compute party running the middle.

    Each party keeps the KV cache of its own layers (``StageCache``): A of its
    front and back blocks and the top query layer, B of the middle blocks. Per
    step A embeds the new positions and runs its front, sends only their
    hidden states (``GEN_STEP``), runs B's answer through its back and the
    head. Token ids stay here; the prompt runs once. ``close`` (or the end of
    the session) frees B's cache.
    """

    def __init__(self, session: DataSession, capacity: int) -> None:
        self.session = session
        self.capacity = capacity
        front, back = session.front, session.back
        self.front_cache = front.new_cache(capacity)
        self.back_cache = back.new_cache(capacity)
        self.device = session.state.device
        self.open = False

    @torch.no_grad()
    def start(self, prompt: Sequence[int]) -> torch.Tensor:
        if self.open:
            raise RuntimeError("this decoder already started a sequence")
        s = self.session
        s.state.train(False)  # no dropout while generating
        s._open_round(proto.Control.gen_start(self.capacity))
        self.open = True
        return self._run(list(prompt))

    def step(self, token: int) -> torch.Tensor:
        return self._run([token])

    @torch.no_grad()
    def _run(self, ids: list[int]) -> torch.Tensor:
        s = self.session
        first, n = self.front_cache.length, len(ids)
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        r = s._open_round(proto.Control.gen_step(first, n))
        # fp32 on every device, as ``aisyn generate`` runs the whole model
        clean = s.front(x, cache=self.front_cache)
        sent = s._protect(clean, "gen", r)
        s.link.send("act", sent, step=r)
        y = s._recv_hidden(r, 1, n, f"for positions [{first}, {first + n})")
        y = s._restore(y.to(self.device), clean, sent)
        # Every new position goes through the back blocks (their keys and
        # values are cached); only the last one's logits are needed.
        out = s.back(y, cache=self.back_cache)[0, -1]
        return s.back.logits(out)

    def close(self) -> None:
        """Ask B to free its cache (the session may go on)."""
        if self.open:
            self.open = False
            self.session._open_round(proto.Control.gen_end())
