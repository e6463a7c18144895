"""Tenants' micro-batches through the one frozen base together: one forward
and one backward for all, each row with its own tenant's adapters.

A centre's LoRA sessions share one copy of the base (``ComputeParty.
frozen_base``); each session runs its own forward and backward over it in
its turn. When several sessions' micro-batches are waiting at once -- their
activations received, B busy -- the turn that comes first takes them all:
their rows are stacked, the base's blocks run once over the stack (one GEMM
per layer instead of one per session: what multi-adapter serving does, as
S-LoRA and Punica), and each target layer adds every session's own adapter
delta ``B_t A_t x`` to that session's rows only. Each session's backward
waits for the others' gradients of the same batch and they go back through
the stack in one pass; adapters get gradients only from their own rows, so
each tenant's update is its solo run's (to float rounding: the GEMMs see
more rows).

A session whose data party is slow to send its gradient must not hold the
others: after ``straggler_s`` a waiting session goes back through the shared
graph alone (its rows' gradient, zeros elsewhere), and the batch's own pass
leaves its rows out. Correct either way; the batched pass is the cheap one.

The carrier is a module tree of its own over the same frozen tensors, with no
adapters: forward hooks on its target layers add the adapters of the batch
being run. Which batch that is comes from a thread-local, set by whichever
thread runs the batch's forward or backward -- which also covers activation
checkpointing, whose recompute runs in the backward's thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from aisyn.model.causal_lm import Layout
from aisyn.model.families import ModelConfig
from aisyn.model.segments import (
    COMPUTE_PARTY,
    Partition,
    build_party_model,
    segments_of,
)
from aisyn.train.lora import ADAPTER_NAME

#: how long a session's backward waits for the rest of its batch's gradients
STRAGGLER_S = 0.5
#: how long a session waits for the batched forward another turn is running
FORWARD_WAIT_S = 600.0


@dataclass(eq=False)
class Request:
    """One session's micro-batch waiting to go through the base."""

    x: torch.Tensor  # its received activations, a leaf requiring grad
    layers: dict[str, nn.Module]  # its LoRA layers, by the carrier's path
    params: list[torch.Tensor]  # its adapters' parameters
    #: set (under the batcher's lock) once a turn has taken it into a batch
    claimed: bool = False
    #: set once that batch's forward has run (``slot`` then holds its rows)
    taken: threading.Event = field(default_factory=threading.Event)
    slot: Slot | None = None


@dataclass(eq=False)
class Batch:
    """Rows of several sessions, run through the base in one forward."""

    layout: list[tuple[int, int, dict[str, nn.Module]]]  # (start, stop, layers)
    #: each member's leaves: its activations and its adapters (a pass for
    #: some members accumulates into theirs alone, not zeros into the rest)
    leaves: list[list[torch.Tensor]]
    y: torch.Tensor | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: member -> its output gradient (None: not yet; "solo": gone alone)
    grads: dict[int, torch.Tensor | str] = field(default_factory=dict)
    #: the batch's backward pass has begun (its members are those in it then)
    started: bool = False
    ran: threading.Event = field(default_factory=threading.Event)


@dataclass(eq=False)
class Slot:
    """A session's rows of a batch: its output, and its way back."""

    batcher: AdapterBatcher
    batch: Batch
    index: int
    y: torch.Tensor  # this session's rows of the batch's output

    def backward(self, g: torch.Tensor, turn: Callable) -> None:
        """Send ``g`` back through this session's rows (``turn``: a turn at
        B's compute, taken only by the pass that computes)."""
        self.batcher.backward(self, g, turn)


def _checkpoint_each_call(model: nn.Module, layout: Layout) -> None:
    """Activation checkpointing of the carrier's blocks, as each call's own
    (``torch.utils.checkpoint``, non-reentrant): two turns run batches
    through the one carrier at once, and torch's composable ``checkpoint``
    (``train.recompute``, what the sessions' own models use) keeps its state
    on the module, which two concurrent forwards trip over."""
    from torch.utils.checkpoint import checkpoint

    for i in range(layout.num_layers):
        try:
            block = model.get_submodule(layout.block_path(i))
        except AttributeError:
            continue  # another party's block
        forward = block.forward

        def checkpointed(*args, _forward=forward, **kwargs):
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = checkpointed


class AdapterBatcher:
    """The batched path of one frozen base's LoRA sessions."""

    def __init__(
        self,
        cfg: ModelConfig,
        partition: Partition,
        frozen: dict[str, torch.Tensor],
        device: torch.device,
        *,
        activation_checkpointing: bool = False,
        targets: list[str],
        max_rows: int = 64,
        straggler_s: float = STRAGGLER_S,
    ) -> None:
        """``targets``: the module paths LoRA adapts on this party's blocks."""
        model = build_party_model(
            cfg, partition, COMPUTE_PARTY, device=device, frozen=frozen
        )
        if activation_checkpointing:
            _checkpoint_each_call(model, cfg.layout)
        (self.middle,) = segments_of(model, partition, COMPUTE_PARTY)
        self.middle.train(True)
        self.targets = list(targets)
        self.max_rows = max_rows
        self.straggler_s = straggler_s
        self._local = threading.local()
        self._lock = threading.Lock()
        self._pending: list[Request] = []
        self.batches = 0  # forwards run, and how many sessions' rows they held
        self.batched_rows = 0
        for path in self.targets:
            model.get_submodule(path).register_forward_hook(self._adapters(path))

    def _adapters(self, path: str):
        def hook(module: nn.Module, args, out: torch.Tensor) -> torch.Tensor:
            layout = self._local.layout
            x = args[0]
            deltas = []
            for start, stop, layers in layout:
                layer = layers[path]  # peft's LoraLayer of this session
                xs = x[start:stop].to(layer.lora_A[ADAPTER_NAME].weight.dtype)
                a = layer.lora_A[ADAPTER_NAME](layer.lora_dropout[ADAPTER_NAME](xs))
                deltas.append(
                    layer.lora_B[ADAPTER_NAME](a) * layer.scaling[ADAPTER_NAME]
                )
            return out + torch.cat(deltas).to(out.dtype)

        return hook

    @contextlib.contextmanager
    def _running(self, batch: Batch) -> Iterator[None]:
        self._local.layout = batch.layout
        try:
            yield
        finally:
            self._local.layout = None

    def session_layers(self, model: nn.Module) -> dict[str, nn.Module]:
        """A session's LoRA layers by the carrier's module paths."""
        return {path: model.get_submodule(path) for path in self.targets}

    # --- forward -----------------------------------------------------------

    def forward(
        self,
        x: torch.Tensor,
        layers: dict[str, nn.Module],
        params: list[torch.Tensor],
        turn: Callable[[], contextlib.AbstractContextManager],
        autocast: Callable[[], contextlib.AbstractContextManager],
    ) -> Slot:
        """Run ``x`` (a session's micro-batch, no attention mask) through the
        base with ``layers``' adapters (``params``: theirs), together with
        whatever other sessions' micro-batches of the same shape are waiting
        by then."""
        req = Request(x, layers, params)
        with self._lock:
            self._pending.append(req)
        with turn():
            with self._lock:
                # None: another session's turn took it (it runs, or has run)
                group = None if req.claimed else self._take(req)
            if group is not None:
                self._run(group, autocast)
        # (outside the turn: another is running it; a forward is compute alone,
        # no network wait, so the bound is only against a bug)
        if not req.taken.wait(FORWARD_WAIT_S) or req.slot is None:
            raise RuntimeError(
                "the batched forward this micro-batch was in failed (see the log)"
            )
        return req.slot

    def _take(self, req: Request) -> list[Request]:
        """``req`` and the waiting requests of its shape, up to ``max_rows``."""
        shape = tuple(req.x.shape[1:])
        group, rows = [req], req.x.shape[0]
        for other in self._pending:
            if other is req or tuple(other.x.shape[1:]) != shape:
                continue
            if rows + other.x.shape[0] > self.max_rows:
                break
            group.append(other)
            rows += other.x.shape[0]
        for r in group:
            self._pending.remove(r)
            r.claimed = True
        return group

    def _run(self, group: list[Request], autocast) -> None:
        layout, start = [], 0
        for r in group:
            layout.append((start, start + r.x.shape[0], r.layers))
            start += r.x.shape[0]
        batch = Batch(layout, [[r.x, *r.params] for r in group])
        try:
            with self._running(batch), autocast():
                x = group[0].x if len(group) == 1 else torch.cat([r.x for r in group])
                batch.y = self.middle(x, None)
        except BaseException:
            # every member's thread must hear of it, not wait forever
            for r in group:
                r.slot = None
                r.taken.set()
            raise
        with self._lock:  # (two turns may finish batches at once)
            self.batches += 1
            self.batched_rows += len(group)
        for i, (r, (a, b, _)) in enumerate(zip(group, layout, strict=True)):
            r.slot = Slot(self, batch, i, batch.y[a:b])
            r.taken.set()

    # --- backward ------------------------------------------------------------

    def backward(self, slot: Slot, g: torch.Tensor, turn: Callable) -> None:
        batch = slot.batch
        with batch.lock:
            batch.grads[slot.index] = g
            lead = _ready(batch)
        if lead:  # the last one in runs the batch's pass
            self._backward_batch(batch, turn)
            return
        if batch.ran.wait(self.straggler_s):
            return
        with batch.lock:
            solo = not batch.started  # else the pass runs, with these rows
            if solo:
                batch.grads[slot.index] = "solo"  # the batch's pass leaves it out
                lead = _ready(batch)
        if not solo:
            batch.ran.wait(FORWARD_WAIT_S)
            return
        with turn(), self._running(batch):
            # this session's rows alone; the graph stays for the others
            torch.autograd.backward(
                slot.y, g, retain_graph=True, inputs=batch.leaves[slot.index]
            )
        if lead:
            self._backward_batch(batch, turn)

    def _backward_batch(self, batch: Batch, turn: Callable) -> None:
        with batch.lock:
            grads = [batch.grads.get(i) for i in range(len(batch.layout))]
        live = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor)]
        # A member gone alone may still be going back through the graph; with
        # none, this pass is the graph's last and frees it as it goes.
        keep = len(live) < len(grads)
        try:
            if live:
                assert batch.y is not None
                ys = [batch.y[batch.layout[i][0] : batch.layout[i][1]] for i in live]
                leaves = [t for i in live for t in batch.leaves[i]]
                with turn(), self._running(batch):
                    torch.autograd.backward(
                        ys, [grads[i] for i in live], retain_graph=keep, inputs=leaves
                    )
        finally:
            batch.ran.set()


def _ready(batch: Batch) -> bool:
    """Whether every member's gradient is in (or it went alone) and no pass
    has started: then the caller runs it (under ``batch.lock``)."""
    if batch.started or len(batch.grads) < len(batch.layout):
        return False
    batch.started = True
    return True
