"""Flower's strategies, guarded: every client update is checked before aggregation.

The strategies are Flower's own (``flwr.serverapp.strategy``): FedAvg, FedProx,
FedAdam and FedAvgM, SCAFFOLD on Flower's FedAvg (``fl.scaffold``), and in
place of FedAvg's weighted mean (setting ``aggregation``) FedTrimmedAvg,
FedMedian, Krum, MultiKrum or Bulyan. We only put ``UpdateGuard``
(``fl.guard``) in front of them, and, where asked, Flower's client-level DP
around them (``fl.dp``).
"""

from __future__ import annotations

from flwr.serverapp.strategy import (
    Bulyan,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedProx,
    FedTrimmedAvg,
    Krum,
    MultiKrum,
    Strategy,
)

from aisyn.fl.dp import with_dp
from aisyn.fl.guard import UpdateGuard
from aisyn.fl.records import WEIGHT_KEY
from aisyn.fl.scaffold import Scaffold
from aisyn.fl.settings import FLSettings


class GuardedFedAvg(UpdateGuard, FedAvg):
    pass


class GuardedFedProx(UpdateGuard, FedProx):
    pass


class GuardedFedAdam(UpdateGuard, FedAdam):
    pass


class GuardedFedAvgM(UpdateGuard, FedAvgM):
    pass


class GuardedScaffold(UpdateGuard, Scaffold):
    pass


class GuardedFedTrimmedAvg(UpdateGuard, FedTrimmedAvg):
    pass


class GuardedFedMedian(UpdateGuard, FedMedian):
    pass


class GuardedKrum(UpdateGuard, Krum):
    pass


class GuardedMultiKrum(UpdateGuard, MultiKrum):
    pass


class GuardedBulyan(UpdateGuard, Bulyan):
    pass


#: a fraction of the connected clients so small that Flower's FedAvg samples
#: exactly ``min_train_nodes`` of them (it samples max(int(N x fraction), min))
SAMPLE_EXACTLY = 1e-9


def make_strategy(settings: FLSettings) -> Strategy:
    """The configured Flower strategy behind an ``UpdateGuard``, wrapped in
    Flower's client-level DP when asked (``aisyn.fl.dp``; ``guard_of`` finds
    the guard inside)."""
    n = settings.min_clients
    f = settings.assumed_attackers
    dp = settings.dp != "off"
    common = dict(
        # under DP exactly the sampled clients train (the noise is calibrated to
        # their number); otherwise every connected client, min-clients at least
        fraction_train=SAMPLE_EXACTLY if dp else 1.0,
        min_train_nodes=settings.sampled_clients,
        fraction_evaluate=1.0,
        min_evaluate_nodes=n,
        min_available_nodes=n,
        weighted_by_key=WEIGHT_KEY,
    )
    strategy: UpdateGuard
    if settings.aggregation == "trimmed-mean":
        strategy = GuardedFedTrimmedAvg(**common, beta=settings.trim_fraction)
    elif settings.aggregation == "median":
        strategy = GuardedFedMedian(**common)
    elif settings.aggregation == "krum":
        strategy = GuardedKrum(**common, num_malicious_nodes=f)
    elif settings.aggregation == "multikrum":
        # average the n - f updates Krum scores best (all but the assumed attackers)
        strategy = GuardedMultiKrum(
            **common, num_malicious_nodes=f, num_nodes_to_select=max(1, n - f)
        )
    elif settings.aggregation == "bulyan":
        strategy = GuardedBulyan(**common, num_malicious_nodes=f)
    elif settings.strategy == "fedavg":
        strategy = GuardedFedAvg(**common)
    elif settings.strategy == "fedprox":
        strategy = GuardedFedProx(**common, proximal_mu=settings.proximal_mu)
    elif settings.strategy == "fedadam":
        strategy = GuardedFedAdam(
            **common,
            eta=settings.eta,
            eta_l=settings.train.lr,
            beta_1=settings.beta_1,
            beta_2=settings.beta_2,
            tau=settings.tau,
        )
    elif settings.strategy == "fedavgm":
        strategy = GuardedFedAvgM(
            **common,
            server_learning_rate=settings.server_lr,
            server_momentum=settings.server_momentum,
        )
    elif settings.strategy == "scaffold":
        strategy = GuardedScaffold(**common)
        strategy.server_learning_rate = settings.server_lr
    else:  # FLSettings validates the names; this is a programming error
        raise AssertionError((settings.strategy, settings.aggregation))
    strategy._guard_init(settings)
    return with_dp(strategy, settings)  # type: ignore[arg-type]


def guard_of(strategy: Strategy) -> UpdateGuard:
    """The ``UpdateGuard`` of ``make_strategy``'s strategy (inside a DP wrapper)."""
    inner = getattr(strategy, "strategy", strategy)
    assert isinstance(inner, UpdateGuard)
    return inner
