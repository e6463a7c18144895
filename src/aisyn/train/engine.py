"""The one training loop: ``Engine(...).run(regime, steps)``.

The engine owns what every run shares: the step cadence (log, validate,
checkpoint, plot), the metrics record, the progress bar, TensorBoard event
files, the summary, resuming (``restore``: the regime's checkpoint, the
engine's own clock and token count, the metrics rows after it dropped) and a
shutdown that closes what it opened however the loop ends. The regime
(``train.regime``: objective x executor) says what a step is.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from aisyn.train import checkpoint as ckpt
from aisyn.train.config import TrainConfig
from aisyn.train.regime import Regime
from aisyn.train.run import PLOT, RunDir

log = logging.getLogger("aisyn.train")


def finished(run: RunDir, folder: Path, total: int) -> dict | None:
    """A run resumed from checkpoint ``folder`` with ``--steps`` ``total``:
    None when steps are left; the run's summary when it is already at
    ``total`` (nothing to train: its last logged loss, tokens and time).
    A ``total`` below the checkpoint is refused (ValueError), as running
    ``range(done, total)`` would train nothing and report a NaN loss."""
    state = ckpt.read_state(folder)
    done = state["step"]
    if done > total:
        raise ValueError(
            f"--steps {total} is below the {done} steps {run.path} has already "
            f"trained; give --steps above {done} to continue it"
        )
    if done < total:
        return None
    log.info("%s: already at step %d, nothing to do", run.path, done)
    losses = [r["loss"] for r in run.read_metrics() if "loss" in r]
    plot = run.path / PLOT
    return {
        "run": str(run.path),
        "steps": int(done),
        "tokens": int(state.get("tokens", 0)),
        "final_loss": losses[-1] if losses else math.nan,
        "elapsed_s": float(state.get("elapsed_s", 0.0)),
        "plot": str(plot) if plot.is_file() else None,
        "records": [],
    }


class Engine:
    """Runs a regime's steps with one cadence.

    ``log_every``, ``eval_every`` and ``ckpt_every`` count completed steps (0:
    never; the last step always logs, validates when validation is on, and
    checkpoints); ``main`` is False on data-parallel ranks other than 0, which
    step but write nothing.
    """

    def __init__(
        self,
        run: RunDir | None,
        *,
        total_steps: int,
        log_every: int,
        eval_every: int = 0,
        ckpt_every: int = 0,
        desc: str = "train",
        progress: bool = True,
        main: bool = True,
        tensorboard: bool = False,
        plot_title: str | None = None,
        time_key: str = "elapsed_s",
        log_range_edges: bool = False,
        plot: bool = True,
    ) -> None:
        self.run_dir = run
        self.total_steps = total_steps
        self.log_every = log_every
        self.eval_every = eval_every
        self.ckpt_every = ckpt_every
        self.desc = desc
        self.progress = progress
        self.main = main
        self.tensorboard = tensorboard and run is not None and main
        self.plot_title = plot_title
        self.time_key = time_key
        #: also log the first and last step of every ``run`` (a federated
        #: client's round), not only of the whole run
        self.log_range_edges = log_range_edges
        self.plot = plot  # the loss plot, redrawn at every checkpoint
        self._last_plot: Path | None = None
        self.tokens = 0
        self.elapsed0 = 0.0
        self._t0 = time.perf_counter()

    @classmethod
    def for_config(cls, run: RunDir | None, cfg: TrainConfig, **kw) -> Engine:
        """An engine with the steps and cadence of a ``TrainConfig``."""
        return cls(
            run,
            total_steps=cfg.steps,
            log_every=cfg.log_every,
            eval_every=cfg.eval_every,
            ckpt_every=cfg.ckpt_every,
            **kw,
        )

    # --- resume state ---------------------------------------------------------

    def state_dict(self) -> dict:
        return {"elapsed_s": self.elapsed(), "tokens": self.tokens}

    def load_state_dict(self, state: dict) -> None:
        self.elapsed0 = float(state.get("elapsed_s", 0.0))
        self.tokens = int(state.get("tokens", 0))

    def elapsed(self) -> float:
        return self.elapsed0 + time.perf_counter() - self._t0

    def restore(self, regime: Regime, folder: Path | None, *, resume: bool) -> int:
        """Put ``regime`` where checkpoint ``folder`` left it (None: at its
        start) and return the step to go on from. Resuming drops the metrics
        rows after that step, from step 0 too: a killed attempt's rows would
        otherwise stay ahead of the rerun's (steps 1, 2, 1, 2, 3, ...)."""
        state = regime.load(folder)
        start = 0
        if state is not None:
            self.load_state_dict(state)
            start = int(state["step"])
            log.info("resumed from %s (step %d)", folder, start)
        elif resume:
            log.info("%s: no checkpoint yet; starting from step 0", self.run_dir.path)
        if resume and self.main:
            self.run_dir.truncate_metrics(start)
        return start

    # --- the loop ---------------------------------------------------------------

    def run(self, regime: Regime, steps: range) -> dict:
        """Run ``steps`` (0-based global step indices); returns the summary.

        The last step of ``steps`` checkpoints; it validates and logs too when
        it is the run's last step (``total_steps``).
        """
        self._t0 = time.perf_counter()
        last: dict = {}
        records: list[dict] = []
        if self.tensorboard:
            self.run_dir.enable_tensorboard()
        bar = tqdm(
            total=self.total_steps,
            initial=steps.start,
            disable=not (self.progress and self.main) or None,
            desc=self.desc,
            unit="step",
            dynamic_ncols=True,
        )
        try:
            with logging_redirect_tqdm():
                for step in steps:
                    last = regime.train_step(step)
                    self.tokens += regime.tokens_per_step
                    done = step + 1
                    bar.update(1)
                    bar.set_postfix(loss=f"{last['loss']:.4f}")
                    if not self.main:
                        if regime.executor.collective:
                            self._follow(regime, done, steps)
                        continue
                    record = self._after_step(regime, done, last, steps)
                    if record is not None:
                        records.append(record)
        finally:
            bar.close()
            if self.tensorboard:
                self.run_dir.close()
        plot = self._last_plot
        return {
            "run": str(self.run_dir.path) if self.run_dir else None,
            "steps": self.total_steps,
            "tokens": self.tokens,
            "final_loss": last.get("loss", math.nan),
            "elapsed_s": self.elapsed(),
            "plot": str(plot) if plot else None,
            "records": records,
        }

    def _after_step(
        self, regime: Regime, done: int, result: dict, steps: range
    ) -> dict | None:
        final = done == self.total_steps
        edge = self.log_range_edges and done in (steps.start + 1, steps.stop)
        record = None
        if (
            (self.log_every and done % self.log_every == 0)
            or final
            or done == 1
            or edge
        ):
            record = {"step": done, **regime.record_fields(), **result}
            record.update(self._progress_fields())
            log.info("%s", regime.log_line(done, self.total_steps, result))
        if self._validates(done):
            val = regime.validate()
            if val is not None:
                record = record or {"step": done, **self._progress_fields()}
                record["val_loss"] = val
                log.info("step %d valid loss: %.6f", done, val)
        if record is not None:
            # Before the checkpoint: a step whose checkpoint exists is logged.
            if self.run_dir is not None:
                self.run_dir.log_metrics(record)
        if self._checkpoints(done, steps):
            regime.save(done, {**self.state_dict(), **regime.state_dict()})
            self._plot()
        return record

    def _validates(self, done: int) -> bool:
        final = done == self.total_steps
        return bool(self.eval_every) and (done % self.eval_every == 0 or final)

    def _checkpoints(self, done: int, steps: range) -> bool:
        return bool(self.ckpt_every and done % self.ckpt_every == 0) or (
            done == steps.stop
        )

    def _follow(self, regime: Regime, done: int, steps: range) -> None:
        """A rank other than 0 of a collective executor: its part in rank 0's
        validation and checkpoint after step ``done`` (nothing written)."""
        if self._validates(done):
            regime.validate()
        if self._checkpoints(done, steps):
            regime.save(done, {**self.state_dict(), **regime.state_dict()})

    def _progress_fields(self) -> dict:
        fields: dict = {"tokens": self.tokens} if self.tokens else {}
        fields[self.time_key] = round(self.elapsed(), 4)
        return fields

    # --- outputs ----------------------------------------------------------------

    def _plot(self) -> Path | None:
        if self.run_dir is not None and self.plot:
            self._last_plot = self.run_dir.plot(self.plot_title)
        return self._last_plot
