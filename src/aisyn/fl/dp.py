"""Client-level differential privacy: Flower's fixed-clipping wrappers, and ε.

``--dp client`` wraps the guarded strategy in Flower's
``DifferentialPrivacyClientSideFixedClipping``: each round's config carries
the clipping norm C, every client clips its update (reply minus the global
model it received) to L2 norm C with Flower's ``fixedclipping_mod``
(``aisyn.fl.client_app``), and the server adds Gaussian noise of standard
deviation ``noise-multiplier x C / sampled clients`` to the mean of the
updates. ``--dp server`` (``DifferentialPrivacyServerSideFixedClipping``) clips
on the server instead: the clients need not be trusted to clip, but the server
sees every unclipped update. Either way the noise is calibrated to the *plain
mean of a fixed number* of clipped updates, so under DP

* each client counts once (uniform weights, not by num-examples), and
* a round whose replies are not exactly the sampled clients' well-formed
  updates (one failed, timed out or was malformed) releases nothing: the mean
  of fewer updates would move by more than C / n per client than the noise
  hides. The last global model stands (``StrictReplies``).

ε is accounted with Google's ``dp_accounting`` (RDP, ``aisyn.accountant``):
the release of round r is a Gaussian mechanism of noise multiplier σ on one
client's contribution (add/remove one client's update, sensitivity C / n on a
mean over n), so R rounds compose ``GaussianDpEvent(σ)`` R times; when only k of the N =
min-clients clients are sampled per round, each round is counted as Poisson
sampling with q = k / N (``PoissonSampledDpEvent``: the usual approximation
for Flower's fixed-size sampling; N is the fewest clients that can be
connected, so q is an upper bound and ε with it). Every round counts, released
or not (an upper bound). The server reports ε at ``dp-delta`` (default 1e-5,
below 1 / N for any federation of organisations) after each round in
``metrics.jsonl`` and in ``result.json``.

What DP protects: whether one client took part, and so anything its data alone
did to the model, is hidden up to ε from whoever sees the global models
(other clients, later users of the model). What not: with ``--dp client`` the
server still sees each clipped update (unless secure aggregation hides them:
then only the sum); with ``--dp server`` it sees them unclipped; metrics
(losses, example counts) travel in the clear and are not accounted.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Strategy,
)

from aisyn.accountant import epsilon
from aisyn.fl.records import UpdateRejected, check_reply
from aisyn.fl.settings import FLSettings

log = logging.getLogger("aisyn.fl.server")


def sample_rate(settings: FLSettings) -> float:
    return settings.sampled_clients / settings.min_clients


def settings_epsilon(settings: FLSettings, rounds: int) -> float:
    """ε of a run with these settings after ``rounds`` rounds."""
    return epsilon(
        settings.dp_noise_multiplier, sample_rate(settings), rounds, settings.dp_delta
    )


class StrictReplies:
    """Before Flower's DP wrapper: a round releases an aggregate only when every
    sampled client sent a well-formed update (see the module's docstring).

    Flower's own wrappers already skip rounds with error replies; this also
    skips rounds with missing (timed out) or malformed replies, which would
    otherwise be averaged with too little noise, or crash the server-side
    clipping (it subtracts arrays before our guard has checked their shapes).
    """

    strategy: Strategy
    num_sampled_clients: int

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        guard = self.strategy
        problem = None
        if len(replies) != self.num_sampled_clients:
            problem = (
                f"{len(replies)} of {self.num_sampled_clients} sampled clients replied"
            )
        for msg in replies:
            try:
                check_reply(msg, guard.expected)  # type: ignore[attr-defined]
            except UpdateRejected as e:
                problem = f"node {msg.metadata.src_node_id}: {e}"
                break
        if problem is not None:
            log.warning(
                "round %d: DP releases nothing this round (%s); keeping the last "
                "global model",
                server_round,
                problem,
            )
            entry = guard.round_log.setdefault(  # type: ignore[attr-defined]
                server_round, {"round": server_round}
            )
            entry["dp_skipped"] = problem
            return None, None
        return super().aggregate_train(server_round, replies)  # type: ignore[misc]


class ClientSideDP(StrictReplies, DifferentialPrivacyClientSideFixedClipping):
    pass


class ServerSideDP(StrictReplies, DifferentialPrivacyServerSideFixedClipping):
    pass


def with_dp(strategy: Strategy, settings: FLSettings) -> Strategy:
    """``strategy`` wrapped in Flower's fixed-clipping DP, as configured."""
    if settings.dp == "off":
        return strategy
    wrapper = ClientSideDP if settings.dp == "client" else ServerSideDP
    return wrapper(
        strategy,
        noise_multiplier=settings.dp_noise_multiplier,
        clipping_norm=settings.dp_clipping_norm,
        num_sampled_clients=settings.sampled_clients,
    )
