"""``DiLoCoExecutor``: a centre's local executor wrapped from outside, the
outer step every H steps.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from aisyn.errors import RunFailedError
from aisyn.train import checkpoint as ckpt
from aisyn.train.diloco.config import OUTER_FILE, DiLoCoConfig, OuterStepError
from aisyn.train.diloco.outer import Exchange, OuterSync
from aisyn.train.diloco.topology import Topology
from aisyn.train.objective import StepBatch
from aisyn.train.regime import Executor
from aisyn.train.run import RunDir

# --- the executor ------------------------------------------------------------------


class DiLoCoExecutor(Executor):
    """A centre's local executor, with an outer step every ``inner_steps``
    (for each fragment of the model, at its own step)."""

    def __init__(
        self, inner, syncs: list[OuterSync], cfg: DiLoCoConfig, where: Topology
    ) -> None:
        """``inner``: a ``train.executor.LocalExecutor`` (DDP over
        ``where.inner`` for a centre of several ranks; its checkpoints carry
        the outer optimizer's state too); ``syncs``: one per fragment."""
        self.inner = inner
        self.syncs = syncs
        self.cfg = cfg
        self.where = where
        self.under_way: dict[int, Exchange] = {}  # fragment -> its exchange
        inner.extra_files = lambda: {OUTER_FILE: self._state_tensors()}

    def release(self) -> None:
        """The inner executor's DDP, dropped before the groups go."""
        self.inner.release()

    def step(self, step: int, batch: StepBatch) -> dict:
        try:
            record = self.inner.step(step, batch)
        except RuntimeError as e:
            if not _collective_failed(e):
                raise
            # DDP inside the centre: one of its ranks gone
            raise self._failed(e, f"step {step + 1}", "a rank of this centre") from None
        done, f = step + 1, None
        try:
            for f, sync in enumerate(self.syncs):
                if self.cfg.due(done, f, self.cfg.overlap_steps):
                    self.under_way[f] = sync.start()
            last = done == self.inner.cfg.steps
            for f, sync in enumerate(self.syncs):
                if self.cfg.due(done, f):
                    # the run's last outer step puts the global model in place
                    # whole, so every centre ends with the same one
                    mixing = 0.0 if last else self.cfg.merge
                    record.update(sync.finish(self.under_way.pop(f), mixing))
                    if len(self.syncs) > 1:
                        record["fragment"] = f
                elif last:  # the fragments synchronised earlier: once more
                    record.update(sync.step())
        except RuntimeError as e:  # gloo / NCCL: a centre gone, a timeout
            if isinstance(e, OuterStepError):
                raise
            n = self.syncs[f].steps + 1 if f is not None else 1
            what = f"outer step {n} (after step {done})"
            if len(self.syncs) > 1:
                what = f"fragment {f}'s {what}"
            raise self._failed(e, what, "another centre") from None
        if "outer_step" in record:
            record["outer_bytes_sent"] = self.bytes_sent
        return record

    @property
    def bytes_sent(self) -> int:
        return sum(s.bytes_sent for s in self.syncs)

    def _failed(self, e: BaseException, what: str, who: str) -> RunFailedError:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return RunFailedError(
            f"{self.where.name(self.where.job.rank)}: {what} failed: {first}; "
            f"{who} stopped or the link broke. The last checkpoint of every "
            "centre is an outer step's: run again with --resume"
        )

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """``split``: this rank's rows of every global batch, as DDP's ranks
        take them; ``own``: its share of its centre's batch."""
        if self.cfg.data == "split":
            return self.where.job.shard(batch)
        return self.where.inner.shard(batch)

    def eval_model(self) -> nn.Module:
        return self.inner.eval_model()

    @property
    def collective(self) -> bool:
        return self.inner.collective

    def log_suffix(self, record: dict) -> str:
        if "outer_step" not in record:
            return ""
        which = f" of fragment {record['fragment']}" if "fragment" in record else ""
        sent = record["outer_bytes_sent"]
        return f" (outer step {record['outer_step']}{which}, {sent} B sent so far)"

    def _prefix(self, fragment: int) -> str:
        return "outer." if len(self.syncs) == 1 else f"outer.{fragment}."

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for f, sync in enumerate(self.syncs):
            out.update(sync.state_tensors(self._prefix(f)))
        return out

    def save(self, run: RunDir, step: int, state: dict, keep: int) -> None:
        if step % self.cfg.inner_steps or self.under_way:
            raise AssertionError(f"step {step}: DiLoCo checkpoints after outer steps")
        self.inner.save(run, step, state, keep)

    def load(self, folder: Path | None) -> dict | None:
        state = self.inner.load(folder)
        if folder is not None:
            source = str(folder / OUTER_FILE)
            tensors = ckpt.read_tensors(folder / OUTER_FILE)
            for f, sync in enumerate(self.syncs):
                sync.load_state(tensors, source, self._prefix(f))
        else:
            for sync in self.syncs:
                sync.global_flat.data.copy_(sync.local_flat())
        return state

    def summary(self, steps_run: int) -> dict:
        return {
            **self.inner.summary(steps_run),
            "outer_steps": self.syncs[-1].steps,
            "outer_bytes_sent": self.bytes_sent,
        }


def fragments_of(params: list[nn.Parameter], count: int) -> list[list[nn.Parameter]]:
    """``params`` in ``count`` runs of about equal size, in order (a whole
    tensor in each: the blocks of a transformer fall into runs of blocks)."""
    if count > len(params):
        raise ValueError(
            f"--fragments {count}: this run trains {len(params)} tensors, "
            "fewer than the fragments asked for"
        )
    total, n = sum(p.numel() for p in params), len(params)
    out: list[list[nn.Parameter]] = []
    seen = 0
    for i, p in enumerate(params):
        # the fragment its middle falls in, opening one at a time and leaving
        # a tensor for each fragment still to open
        wanted = int((seen + p.numel() / 2) * count / total)
        last = len(out) - 1
        at = min(max(wanted, last, count - (n - i)), last + 1, count - 1)
        if at > last:
            out.append([])
        out[-1].append(p)
        seen += p.numel()
    return out


def _collective_failed(e: RuntimeError) -> bool:
    """Whether ``e`` is a collective's failure (DDP's reducer raises gloo's
    and NCCL's as plain RuntimeErrors), not a fault of the step itself."""
    return isinstance(e, dist.DistError) or any(
        word in str(e) for word in ("gloo", "NCCL", "Connection closed", "timed out")
    )
