"""The outer step: averaging the centres' deltas (guarded) and stepping the
global model.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from aisyn.train import checkpoint as ckpt
from aisyn.train import fsdp
from aisyn.train.diloco.config import INT8_BLOCK, DiLoCoConfig, OuterStepError
from aisyn.train.diloco.guard import (
    TOLERANCE,
    DeltaGuard,
    Verdict,
    consistent,
    screen_stats,
)
from aisyn.train.diloco.wire import decode, encode, encoded_bytes, ring_bytes_sent
from aisyn.train.distributed import DistContext

log = logging.getLogger(__name__)

# --- the outer step -----------------------------------------------------------------


@dataclass
class Exchange:
    """An outer exchange under way: its collectives (``work.wait()``), and
    what gives the centres' mean delta once they are done; the screening's
    verdict on the centres' deltas, the reference direction it used, and the
    centres found to send other than they reported (``mean`` fills it)."""

    works: list
    mean: Callable[[], torch.Tensor]
    verdict: Verdict | None = None
    reference: torch.Tensor | None = None
    liars: list[int] | None = None


class OuterSync:
    """The global model, its outer optimizer and the exchange of deltas for
    one centre's ``params`` (every centre holds the same, in the same order).

    ``centres``: this rank among the centres (its group: the ranks the
    exchange crosses between); ``inner``: its place in a centre of several
    ranks, which all hold the same model (DDP). Rank i of a centre then
    exchanges the i-th share of the flat delta alone, and the centre's ranks
    gather the averaged shares over their own fast network: the wide-area
    bytes are one delta per centre, over as many connections as it has ranks.

    ``shards``: instead, the centre's ranks when ``params`` are FSDP2's
    shards (``train.fsdp``): rank i then holds, steps and exchanges the
    global model of its own shards alone, and nothing is gathered but what
    a checkpoint holds (the whole global model and momentum, as any other
    centre's).
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        cfg: DiLoCoConfig,
        centres: DistContext,
        inner: DistContext | None = None,
        shards: DistContext | None = None,
    ) -> None:
        self.params = params
        self.cfg = cfg
        self.centres = centres
        self.inner = inner or DistContext()
        self.shards = shards or DistContext()
        if self.inner.enabled and self.shards.enabled:
            raise ValueError("a centre's ranks share the delta, or hold shards")
        self.numel = sum(fsdp.local(p).numel() for p in params)
        self.whole_numel = sum(p.numel() for p in params)
        # a share per rank of the centre, whole int8 blocks each
        blocks = math.ceil(self.numel / INT8_BLOCK)
        per = self.inner.world
        self.share = self.numel if per == 1 else math.ceil(blocks / per) * INT8_BLOCK
        # what each of the centre's ranks exchanges: the bytes it sends
        self.share_sizes = [self.share] * per
        if self.shards.enabled:
            mine = torch.tensor([self.numel], dtype=torch.int64)
            sizes = [torch.empty_like(mine) for _ in range(self.shards.world)]
            dist.all_gather(sizes, mine, group=self.shards.group)
            self.share_sizes = [int(t) for t in sizes]
        with torch.no_grad():
            flat = self.local_flat()
        # The global model as the outer optimizer sees it: one flat tensor,
        # so one SGD step (torch's own, with Nesterov momentum) covers it.
        self.global_flat = nn.Parameter(flat, requires_grad=False)
        self.optimizer = torch.optim.SGD(
            [self.global_flat],
            lr=cfg.outer_lr,
            momentum=cfg.outer_momentum,
            nesterov=cfg.outer_momentum > 0,
        )
        self.steps = 0
        self.skipped_in_row = 0
        self.bytes_sent = 0
        self.guard = DeltaGuard(centres.world, cfg.delta_bound, cfg.delta_min_cosine)
        #: the last applied mean delta: the run's direction without momentum
        self.last_mean: torch.Tensor | None = None

    def local_flat(self) -> torch.Tensor:
        """The centre's own model (of this rank's shards), flat, fp32."""
        with torch.no_grad():
            return torch.cat(
                [fsdp.local(p).detach().reshape(-1).float() for p in self.params]
            )

    @torch.no_grad()
    def put_global(self, mixing: float = 0.0) -> None:
        """Every local parameter := the global model (what each centre goes
        on from), or ``mixing`` of the local one plus the rest of the global
        (Streaming DiLoCo's merge, after inner steps taken while the exchange
        was under way)."""
        offset = 0
        for p in map(fsdp.local, self.params):
            n = p.numel()
            g = self.global_flat[offset : offset + n].view_as(p)
            if mixing:
                p.mul_(mixing).add_(g.to(p.dtype), alpha=1 - mixing)
            else:
                p.copy_(g)
            offset += n

    def reference(self) -> torch.Tensor | None:
        """The run's recent direction (this rank's part): the outer momentum,
        or without one the last applied mean delta; None before either."""
        buf = self.optimizer.state.get(self.global_flat, {}).get("momentum_buffer")
        return buf if buf is not None else self.last_mean

    def screen(self, delta: torch.Tensor, reference: torch.Tensor | None) -> Verdict:
        """Every centre's delta statistics, gathered, and the verdict on them
        (the same on every centre: the same numbers, the same rules)."""
        stats = screen_stats(delta, reference)
        if self.shards.enabled:  # this rank holds shards: the centre's sum
            dist.all_reduce(stats, group=self.shards.group)
        n = self.centres.world
        if n == 1:
            return self.guard.judge(stats[None])
        parts = [torch.empty_like(stats) for _ in range(n)]
        dist.all_gather(parts, stats, group=self.centres.group)
        return self.guard.judge(torch.stack(parts).cpu())

    def start(self) -> Exchange:
        """Start the exchange of this centre's delta (``global - local`` now),
        once every centre has seen every centre's delta statistics: a centre
        out of bound sends zeros and the mean is over the others. The
        collectives run while the centre goes on training."""
        delta = self.global_flat.detach() - self.local_flat()
        reference = self.reference()
        verdict = self.screen(delta, reference)
        if verdict.reasons[self.centres.rank] is not None:
            delta = torch.zeros_like(delta)  # left out: the others' mean applies
        per = self.inner.world
        if per == 1:
            exchange = self._start_share(delta, reference, verdict)
        else:
            size = self.share * per - self.numel
            padded = torch.nn.functional.pad(delta, (0, size))
            ref_share = None
            if reference is not None:
                ref_share = torch.nn.functional.pad(reference, (0, size))
                ref_share = ref_share.view(per, -1)[self.inner.rank]
            share = self._start_share(
                padded.view(per, -1)[self.inner.rank], ref_share, verdict
            )

            def mean() -> torch.Tensor:
                mine = share.mean()
                parts = [torch.empty_like(mine) for _ in range(per)]
                dist.all_gather(parts, mine, group=self.inner.group)
                exchange.liars = share.liars
                return torch.cat(parts)[: self.numel]

            exchange = Exchange(share.works, mean)
        exchange.verdict, exchange.reference = verdict, reference
        return exchange

    def _start_share(
        self, delta: torch.Tensor, reference: torch.Tensor | None, verdict: Verdict
    ) -> Exchange:
        """Start averaging this rank's share ``delta`` over the accepted
        centres (all of it for a centre of one rank); counts the bytes the
        centre sends."""
        n, group = self.centres.world, self.centres.group
        precision = self.cfg.precision
        op = "all_reduce" if precision == "fp32" else "all_gather"
        count = max(1, len(verdict.accepted))
        # every rank of the centre sends its share: the centre's bytes
        self.bytes_sent += sum(
            ring_bytes_sent(encoded_bytes(size, precision), n, op)
            for size in self.share_sizes
        )
        if precision == "fp32":
            total = delta.clone()
            works = (
                [dist.all_reduce(total, group=group, async_op=True)] if n > 1 else []
            )
            return Exchange(works, lambda: total / count, liars=[])
        payload = encode(delta, precision)
        if n == 1:
            return Exchange(
                [], lambda: decode(payload, precision, delta.numel()), liars=[]
            )
        gathered, works = [], []
        for t in payload:
            parts = [torch.empty_like(t) for _ in range(n)]
            works.append(dist.all_gather(parts, t, group=group, async_op=True))
            gathered.append(parts)
        exchange = Exchange(works, lambda: mean(), liars=[])

        def mean() -> torch.Tensor:
            # Every accepted centre's delta as it arrived, checked against
            # what it reported; a centre caught sending another is left out.
            deltas = {
                rank: decode(
                    [parts[rank] for parts in gathered], precision, delta.numel()
                )
                for rank in verdict.accepted
            }
            stats = torch.stack(
                [screen_stats(d, reference)[:2] for d in deltas.values()]
            )
            group_of_centre = self._centre_group()
            if group_of_centre is not None:  # this rank's part of each delta
                dist.all_reduce(stats, group=group_of_centre)
            total = torch.zeros_like(delta)
            kept = 0
            for (rank, d), (sq, dot) in zip(
                deltas.items(), stats.tolist(), strict=True
            ):
                said = (verdict.norms[rank], verdict.dots[rank])
                got = (math.sqrt(max(sq, 0.0)) if math.isfinite(sq) else math.nan, dot)
                if consistent(got, said, verdict.ref_norm, TOLERANCE[precision]):
                    total += d  # in rank order: the same sum on every centre
                    kept += 1
                else:
                    exchange.liars.append(rank)
            return total / max(kept, 1)

        return exchange

    def _centre_group(self):
        """The group of this centre's ranks that hold parts of one delta (a
        share each, or shards); None when this rank holds all of it."""
        if self.shards.enabled:
            return self.shards.group
        return self.inner.group if self.inner.world > 1 else None

    def _adds_up(self, mean: torch.Tensor, exchange: Exchange) -> tuple[bool, float]:
        """fp32 deltas are summed on the way (all-reduce): no centre sees
        another's. The sum must still be what the accepted centres reported:
        no longer than their norms together, and with the dot product with
        the reference they add up to. (whether it does, its norm)"""
        verdict = exchange.verdict
        accepted = verdict.accepted
        summed = mean * len(accepted)
        stats = screen_stats(summed, exchange.reference)
        if self.shards.enabled:
            dist.all_reduce(stats, group=self.shards.group)
        norm = math.sqrt(max(float(stats[0]), 0.0))
        said = (
            sum(verdict.norms[c] for c in accepted),
            sum(verdict.dots[c] for c in accepted),
        )
        got = (norm, float(stats[1]))
        return consistent(got, said, verdict.ref_norm, TOLERANCE["fp32"]), norm

    @torch.no_grad()
    def finish(self, exchange: Exchange, mixing: float = 0.0) -> dict:
        """Wait for ``exchange``, step the global model with the accepted
        centres' mean delta and put it in place (``put_global(mixing)``);
        returns the outer step's record fields."""
        for work in exchange.works:
            work.wait()
        mean = exchange.mean()
        self.steps += 1
        record = {"outer_step": self.steps}
        verdict = exchange.verdict
        me, n = self.centres.rank, self.centres.world
        liars = list(exchange.liars or [])
        record["outer_delta_norms"] = [_json_float(x) for x in verdict.norms]
        record["outer_delta_cosines"] = [_json_float(x) for x in verdict.cosines]
        for c in verdict.refused:
            log.warning(
                "outer step %d: centre %d's delta left out: %s (a centre that "
                "diverged or sends a wrong delta); the mean of the other %d applied",
                self.steps,
                c,
                verdict.reasons[c],
                len(verdict.accepted),
            )
        for c in liars:
            log.warning(
                "outer step %d: centre %d's delta left out: it is not the delta "
                "it reported (its norm and direction differ from its report)",
                self.steps,
                c,
            )
        kept = [c for c in verdict.accepted if c not in liars]
        problem = None
        if not kept and all("not finite" in r for r in verdict.reasons):
            problem = "the averaged delta is not finite"
        elif not kept:
            problem = "no centre's delta is within bounds"
        elif not bool(torch.isfinite(mean).all()):
            problem = "the averaged delta is not finite"
        elif n > 1 and self.cfg.precision == "fp32":
            fits, norm = self._adds_up(mean, exchange)
            if not fits:
                who = f"centre {1 - me}" if n == 2 else "a centre"
                problem = (
                    f"the centres' deltas add up to a norm of {norm:.4g}, more "
                    f"than the {sum(verdict.norms[c] for c in kept):.4g} they "
                    f"reported: {who} sends a delta other than the one it reports"
                )
        self.guard.record(verdict, liars if problem is None else list(range(n)))
        if refused := [c for c in range(n) if c not in kept]:
            record["outer_refused"] = refused
        worst = max(range(n), key=lambda c: self.guard.refused_in_row[c])
        if problem is None and self.guard.refused_in_row[worst] >= self.cfg.max_skipped:
            reason = verdict.reasons[worst] or "it is not the delta it reported"
            raise OuterStepError(
                f"centre {worst}'s delta was out of bound at "
                f"{self.guard.refused_in_row[worst]} outer steps in a row (now: "
                f"{reason}); it diverged or sends wrong deltas: stop it and resume "
                "the others without it (docs/cross_centre.md, a centre lost for "
                "good); the last checkpoint holds the last good global model"
            )
        if problem is not None:
            self.skipped_in_row += 1
            self.put_global()  # the H steps are dropped, on every centre alike
            log.warning(
                "outer step %d skipped: %s (%d in a row)",
                self.steps,
                problem,
                self.skipped_in_row,
            )
            if self.skipped_in_row >= self.cfg.max_skipped:
                hint = (
                    "a centre diverged: lower --lr or --outer-lr"
                    if "not finite" in problem
                    else problem
                )
                raise OuterStepError(
                    f"{self.skipped_in_row} outer steps in a row were skipped "
                    f"({hint}); the last checkpoint holds the last good global model"
                )
            return {**record, "outer_skipped": True}
        self.skipped_in_row = 0
        self.global_flat.grad = mean
        self.optimizer.step()
        self.global_flat.grad = None
        if self.cfg.outer_momentum == 0:
            self.last_mean = mean.clone()
        # a centre left out goes on from the global model alone
        self.put_global(0.0 if me not in kept else mixing)
        record["outer_delta_norm"] = float(mean.norm())
        return record

    def step(self) -> dict:
        """One whole outer step (start, then finish at once)."""
        return {**self.finish(self.start()), "outer_bytes_sent": self.bytes_sent}

    def state_tensors(self, prefix: str = "outer.") -> dict[str, torch.Tensor]:
        """The outer optimizer's momentum and steps, the bytes sent so far,
        and the global model where it is not the model's own weights (a
        fragment synchronised earlier, or merged with ``mixing``)."""
        buf = self.optimizer.state.get(self.global_flat, {}).get("momentum_buffer")
        out = {
            f"{prefix}steps": torch.tensor([self.steps], dtype=torch.int64),
            f"{prefix}bytes_sent": torch.tensor([self.bytes_sent], dtype=torch.int64),
            # the same on every centre: what the next outer step bounds against
            f"{prefix}delta_history": self.guard.state(),
        }
        differs = not torch.equal(self.global_flat.detach(), self.local_flat())
        if self.shards.enabled:  # whole, as every centre's: every rank gathers
            flag = torch.tensor([int(differs)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.shards.group)
            differs = bool(flag)
        for name, t in (("momentum", buf), ("global", self.global_flat)):
            if t is not None and (name == "momentum" or differs):
                t = t.detach()
                if self.shards.enabled:
                    t = fsdp.whole_flat(t, self.params)
                out[f"{prefix}{name}"] = t.cpu()
        return out

    def load_state(
        self, tensors: dict[str, torch.Tensor], source: str, prefix: str = "outer."
    ) -> None:
        if f"{prefix}steps" not in tensors:
            raise ckpt.CheckpointError(
                f"{source}: no {prefix}steps: written with other --fragments"
            )
        self.steps = int(tensors[f"{prefix}steps"][0])
        sent = tensors.get(f"{prefix}bytes_sent")  # (absent in older checkpoints)
        if sent is not None:
            if sent.dtype != torch.int64 or sent.shape != (1,) or int(sent) < 0:
                raise ckpt.CheckpointError(
                    f"{source}: {prefix}bytes_sent is not one count of bytes"
                )
            self.bytes_sent = int(sent)
        n = self.whole_numel
        for what in ("momentum", "global"):
            t = tensors.get(f"{prefix}{what}")
            if t is not None and (t.dtype != torch.float32 or t.shape != (n,)):
                raise ckpt.CheckpointError(
                    f"{source}: outer {what} of {t.numel()} {t.dtype} values, "
                    f"the model's share has {n} float32 ones"
                )
            if t is not None and self.shards.enabled:
                tensors = {
                    **tensors,
                    f"{prefix}{what}": fsdp.shard_flat(t, self.params),
                }
        history = tensors.get(f"{prefix}delta_history")  # (absent in older ones)
        if history is not None and history.dtype != torch.float64:
            raise ckpt.CheckpointError(
                f"{source}: {prefix}delta_history is not float64"
            )
        try:
            self.guard.load(history)
        except ValueError as e:
            raise ckpt.CheckpointError(f"{source}: {prefix}{e}") from None
        glob = tensors.get(f"{prefix}global")
        self.global_flat.data.copy_(self.local_flat() if glob is None else glob)
        buf = tensors.get(f"{prefix}momentum")
        if buf is not None:
            self.optimizer.state[self.global_flat] = {
                "momentum_buffer": buf.to(self.global_flat.device)
            }


def _json_float(x: float) -> float | None:
    """A number for a metrics row (JSON has no NaN)."""
    return x if math.isfinite(x) else None
