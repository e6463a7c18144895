"""One federation: a guarded Flower strategy driven round by round over a grid.

The federated server (``fl.server``) and SplitFed's coordinator
(``splitfed.run``) both run their rounds here. After each round the round's
metrics line is written and the driver checkpoints with what this module adds
to it -- the global arrays, the server optimiser's state (FedAdam's moments,
FedAvgM's momentum) and the random states that sample clients and draw DP
noise -- so that a server killed after round k resumes at round k + 1 and ends
where an uninterrupted run ends.

The loop is Flower's ``Strategy.start`` (configure, send and aggregate: train,
then evaluate), written out so that it can begin at any round: ``start``
numbers rounds from 1, and the round number reaches the clients (it places
their data order and learning-rate schedule).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from aisyn.fl.guard import OPTIMIZER_STATE
from aisyn.fl.settings import FLSettings
from aisyn.fl.strategy import guard_of
from aisyn.train import checkpoint as ckpt
from aisyn.train.run import RunDir, save_figure
from aisyn.validate import name_differences

log = logging.getLogger("aisyn.fl")

#: the global model's loss after every round, in the run folder
LOSS_PNG = "loss.png"
#: the federation's part of a round's checkpoint (beside the driver's files)
FEDERATION_FILE = "federation.safetensors"
_GLOBAL = "global/"
_NUMPY_RNG = "rng.numpy"
#: the settings a checkpoint's strategy state belongs to
_STRATEGY_KEYS = ("strategy", "aggregation", "dp", "method")


class FederationStateError(ckpt.CheckpointError):
    """A federation's saved state cannot be resumed (missing, truncated, or
    another strategy's or model's)."""


@dataclass
class Federation:
    """The rounds of one federation.

    ``describe(round, arrays, entry)`` adds the driver's fields to the round's
    metrics entry (the guard's record of it: clients, accepted, rejected,
    bytes); ``checkpoint(round, arrays, files, state)`` writes the driver's
    checkpoint of the round with ``files`` and ``state`` in it.
    """

    strategy: Strategy
    grid: Grid
    settings: FLSettings
    config: ConfigRecord
    run: RunDir
    spec: dict[str, tuple[int, ...]]
    describe: Callable[[int, ArrayRecord, dict], None]
    checkpoint: Callable[[int, ArrayRecord, dict, dict], None]
    #: where ``checkpoint`` writes (default: ``run``'s own checkpoints)
    checkpoints: Path | None = None
    history: list[dict] = field(default_factory=list)
    #: the clients' evaluation of the last round's global model (its valid loss)
    last_loss: float | None = None
    #: the state of the checkpoint ``resume`` continued from (the driver's too)
    saved_state: dict = field(default_factory=dict)

    def run_rounds(self, arrays: ArrayRecord, first: int = 1) -> float | None:
        """Rounds ``first`` .. R from the global ``arrays``; returns the
        clients' valid loss of the final global model (None: none reported)."""
        timeout = self.settings.round_timeout
        strategy, grid = self.strategy, self.grid
        for rnd in range(first, self.settings.rounds + 1):
            log.info("[ROUND %d/%d]", rnd, self.settings.rounds)
            replies = grid.send_and_receive(
                messages=strategy.configure_train(rnd, arrays, self.config, grid),
                timeout=timeout,
            )
            aggregated, _ = strategy.aggregate_train(rnd, replies)
            if aggregated is not None:
                arrays = aggregated
            replies = grid.send_and_receive(
                messages=strategy.configure_evaluate(rnd, arrays, self.config, grid),
                timeout=timeout,
            )
            evaluated = strategy.aggregate_evaluate(rnd, replies)
            self.last_loss = _valid_loss(evaluated)
            self._after_round(rnd, arrays)
        if (final := self.last_loss) is not None:
            self.run.log_metrics(
                {"round": self.settings.rounds, "final_global_valid_loss": final}
            )
            self._plot(final)
        return final

    def _plot(self, final: float | None = None) -> None:
        fig = global_loss_figure(self.history, final)
        if fig is not None:
            save_figure(fig, self.run.path / LOSS_PNG)

    def _after_round(self, rnd: int, arrays: ArrayRecord) -> None:
        entry = dict(guard_of(self.strategy).round_log.get(rnd, {"round": rnd}))
        t_sent = entry.pop("t_sent", None)
        entry["round_s"] = time.perf_counter() - t_sent if t_sent else None
        self.describe(rnd, arrays, entry)
        self.history.append(entry)
        # the line first: a resume drops the lines after its checkpoint
        self.run.log_metrics(entry)
        self._plot()
        self.checkpoint(rnd, arrays, *self._saved(rnd, arrays))

    # -- what a round's checkpoint holds for the federation -------------------

    def _saved(self, rnd: int, arrays: ArrayRecord) -> tuple[dict, dict]:
        tensors = {_GLOBAL + k: _tensor(a.numpy()) for k, a in arrays.items()}
        kinds: dict[str, str] = {}
        for role, obj in self._stateful():
            for attr in OPTIMIZER_STATE:
                value = getattr(obj, attr, None)
                if value is None:
                    continue
                key = f"{role}.{attr}"
                kinds[key], parts = _flatten(value)
                for name, a in parts.items():
                    tensors[f"{key}/{name}"] = _tensor(a)
        algorithm, keys, pos, has_gauss, cached = np.random.get_state()
        tensors[_NUMPY_RNG] = torch.from_numpy(keys.astype(np.int64))
        tensors.update(ckpt.rng_tensors())
        version, internal, gauss = random.getstate()
        state = {
            "round": rnd,
            "federation": {
                "settings": {k: getattr(self.settings, k) for k in _STRATEGY_KEYS},
                "optimizer_state": kinds,
                "valid_loss": self.last_loss,
                "random": [version, list(internal), gauss],
                "numpy_random": [algorithm, int(pos), int(has_gauss), float(cached)],
            },
        }
        return {FEDERATION_FILE: tensors}, state

    def _stateful(self) -> list[tuple[str, object]]:
        """The strategy objects whose state persists across rounds: the guarded
        strategy and, under client DP, Flower's wrapper around it."""
        inner = guard_of(self.strategy)
        out: list[tuple[str, object]] = [("strategy", inner)]
        if self.strategy is not inner:
            out.append(("wrapper", self.strategy))
        return out

    def resume(self) -> tuple[int, ArrayRecord | None]:
        """(the first round to run, the global arrays to run it from) out of the
        latest checkpoint; (1, None) where no round finished. The history is
        ``run``'s metrics lines up to that round (later ones are dropped).

        Refuses in one line (``FederationStateError``) a checkpoint without the
        federation's state, a truncated file, another strategy's state or
        another model's arrays; nothing is written before the checks pass."""
        folder = ckpt.latest(self.checkpoints or self.run.checkpoints)
        if folder is None:
            log.info("%s: no round finished yet; starting at round 1", self.run.path)
            return 1, None
        state = ckpt.read_state(folder)
        fed = state.get("federation")
        rnd = state.get("round")
        if not isinstance(fed, dict) or not isinstance(rnd, int):
            raise FederationStateError(
                f"{folder}: holds no federation state (not a federated server's "
                "checkpoint, or one from before --resume existed)"
            )
        if not 1 <= rnd <= self.settings.rounds:
            raise FederationStateError(
                f"{folder}: saved at round {rnd}, outside this run's "
                f"1..{self.settings.rounds}"
            )
        ours = {k: getattr(self.settings, k) for k in _STRATEGY_KEYS}
        if fed.get("settings") != ours:
            raise FederationStateError(
                f"{folder}: saved by a federation with {fed.get('settings')}, "
                f"not this one's {ours}"
            )
        try:
            tensors = ckpt.read_tensors(folder / FEDERATION_FILE)
        except ckpt.CheckpointError as e:
            raise FederationStateError(str(e)) from None
        arrays = {
            k.removeprefix(_GLOBAL): v
            for k, v in tensors.items()
            if k.startswith(_GLOBAL)
        }
        problem = name_differences(self.spec, arrays, more=True)
        if problem is None:
            problem = next(
                (
                    f"{k} is {tuple(v.shape)}, this model's {self.spec[k]}"
                    for k, v in arrays.items()
                    if tuple(v.shape) != tuple(self.spec[k])
                ),
                None,
            )
        if problem is not None:
            raise FederationStateError(f"{folder}: saved for another model ({problem})")
        bad = ckpt.first_nonfinite(tensors)
        if bad is not None:
            raise FederationStateError(f"{folder}: {bad} holds non-finite values")
        self._restore(folder, fed, tensors)
        self.last_loss = fed.get("valid_loss")
        self.saved_state = state
        # the lines of the rounds after the checkpoint, and a final one, are redone
        self.run.keep_metrics(
            lambda r: r.get("round", 0) <= rnd and "final_global_valid_loss" not in r
        )
        self.history = self.run.read_metrics()
        # in the spec's order: FedAvgM pairs arrays by position
        return rnd + 1, ArrayRecord({k: Array(arrays[k].numpy()) for k in self.spec})

    def _restore(self, folder: Path, fed: dict, tensors: dict) -> None:
        try:
            kinds = dict(fed["optimizer_state"])
            version, internal, gauss = fed["random"]
            algorithm, pos, has_gauss, cached = fed["numpy_random"]
            keys = tensors[_NUMPY_RNG].numpy().astype(np.uint32)
            np_state = (str(algorithm), keys, int(pos), int(has_gauss), float(cached))
            py_state = (int(version), tuple(int(x) for x in internal), gauss)
            objects = dict(self._stateful())
            restored = {}
            for key, kind in kinds.items():
                role, _, attr = key.partition(".")
                if role not in objects or attr not in OPTIMIZER_STATE:
                    raise ValueError(f"unknown state {key}")
                parts = {
                    k.removeprefix(key + "/"): v.numpy()
                    for k, v in tensors.items()
                    if k.startswith(key + "/")
                }
                restored[(role, attr)] = _unflatten(kind, parts, self.spec)
            # only now, with everything read: set the state
            np.random.set_state(np_state)
            random.setstate(py_state)
        except (KeyError, TypeError, ValueError) as e:
            raise FederationStateError(
                f"{folder}: bad federation state ({e})"
            ) from None
        for (role, attr), value in restored.items():
            setattr(objects[role], attr, value)
        ckpt.restore_rng(tensors)
        log.info("%s: resuming after round %s", self.run.path, folder.name)


def global_loss_figure(history: list[dict], final: float | None):
    """The global model's validation loss (clients' weighted mean) after each
    number of completed rounds: round r's clients score the model of round r-1.
    None when no round has a loss yet."""
    points = [
        (h["round"] - 1, h["global_valid_loss"])
        for h in history
        if h.get("global_valid_loss") is not None
    ]
    if final is not None and history:
        points.append((history[-1]["round"], final))
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    ax.plot(
        *zip(*points, strict=True), "o-", label="global model, clients' valid items"
    )
    ax.set_xlabel("rounds completed")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no round 0.5
    ax.set_ylabel("loss (nats / supervised token)")
    ax.set_title("federated global model")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def _valid_loss(metrics: MetricRecord | None) -> float | None:
    if metrics is None or "valid-loss" not in metrics:
        return None
    return float(metrics["valid-loss"])


def _flatten(value) -> tuple[str, dict[str, np.ndarray]]:
    """A strategy attribute as named arrays: a dict of arrays, an ArrayRecord or
    a list of arrays (FedAvgM's momentum)."""
    if isinstance(value, ArrayRecord):
        return "record", {k: a.numpy() for k, a in value.items()}
    if isinstance(value, dict):
        return "dict", {k: np.asarray(a) for k, a in value.items()}
    if isinstance(value, list | tuple):
        return "list", {f"{i:06d}": np.asarray(a) for i, a in enumerate(value)}
    raise TypeError(f"cannot save strategy state of type {type(value).__name__}")


def _tensor(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(a))  # a copy: Flower's arrays are read-only


def _unflatten(kind: str, parts: dict[str, np.ndarray], spec: dict):
    if kind in ("record", "dict"):
        # named as the global arrays: in their order, as the strategy built them
        if set(parts) == set(spec):
            parts = {k: parts[k] for k in spec}
        if kind == "record":
            return ArrayRecord({k: Array(a) for k, a in parts.items()})
        return parts
    if kind == "list":
        return [parts[k] for k in sorted(parts)]
    raise ValueError(f"unknown kind {kind!r}")
