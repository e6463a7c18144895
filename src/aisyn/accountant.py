"""The privacy budget ε of Gaussian mechanisms, by Google's ``dp-accounting``.

Split training's cut defence (``split.defence.cut_dp``) and federated client-level DP
(``fl.dp``) both release Gaussian mechanisms and report ε; both account it
here, with the RDP accountant, never by hand, so the two are comparable and
the accountant's options are chosen once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

#: the δ ε is reported at unless a run says otherwise (below 1 / the rows of
#: any data set, or the clients of any federation, this project trains on)
DEFAULT_DELTA = 1e-5


def epsilon(
    noise_multiplier: float | Sequence[float],
    sample_rate: float,
    count: int,
    delta: float,
) -> float:
    """ε at ``delta`` of ``count`` releases of the Gaussian mechanism with
    ``noise_multiplier`` (sensitivity 1; several: each release passes through
    one of each, as the cut's forward and backward), each on a ``sample_rate``
    share of the data (Poisson sampling; 1: all of it). ``inf`` when a
    mechanism adds no noise; 0 for no releases."""
    if count == 0:
        return 0.0
    sigmas = (
        [noise_multiplier]
        if isinstance(noise_multiplier, int | float)
        else list(noise_multiplier)
    )
    if any(sigma == 0 for sigma in sigmas):
        return math.inf
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    accountant = rdp_privacy_accountant.RdpAccountant()
    for sigma in sigmas:
        event: dp_event.DpEvent = dp_event.GaussianDpEvent(sigma)
        if sample_rate < 1:
            event = dp_event.PoissonSampledDpEvent(sample_rate, event)
        accountant.compose(event, count)
    return float(accountant.get_epsilon(delta))


def finite_or_none(eps: float) -> float | None:
    """ε as JSON holds it: ``None`` where there is no finite bound."""
    return eps if math.isfinite(eps) else None
