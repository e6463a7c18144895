"""A trained bottleneck at the front cut: what A sends is a noisy channel
whose noise A learns, with a floor that holds whatever it learns.

Per token ``t`` of the front's output ``h_t`` (hidden size ``H``):

* **centre** on ``c_t``, the mean of the front's output at position ``t`` over
  public text (most of an activation's norm is the same for every token,
  docs/privacy.md): only ``z_t = h_t - c_t`` carries the token;
* **clip** ``z_t`` to L2 norm ``R`` (the median norm on public text), *per
  token*: a front that learns to scale its output up cannot outshout the
  noise, as it could under a per-row bound;
* **noise** ``N(0, (σ_i · R / √H)²)`` on every coordinate ``i``, with
  ``σ_i = floor + softplus(ρ_i)`` and ``ρ`` trained by A with its blocks. At
  ``σ_i = 1`` a coordinate's noise is as strong as a full-norm token spread
  evenly over the coordinates.

What A sends is ``c_t + clip(z_t) + noise``; A's back blocks put A's own
residual stream back (``DataSession._restore``) and so act as the denoiser of
what B's blocks added.

The training term: over the micro-batch, coordinate ``i`` carries power
``P_i = mean(v_i²)`` of ``v = √H · clip(z) / R`` through Gaussian noise of
variance ``σ_i²``; ``C = Σ_i ½ log(1 + P_i / σ_i²)`` (nats per token) is the
capacity of that channel at that power, an upper bound on what one token's
activations can tell B about its input. A adds ``β · C`` to its loss: the
noise grows where the task does not need the signal, and the front learns to
put less of the token into what crosses (an information bottleneck, MID /
VIB's idea with the capacity of a Gaussian channel as the bound).

What holds whatever A learns (``capacity_bound``): with ``Σ_i P_i ≤ H`` (the
clip) and ``σ_i ≥ floor``, at most the water-filling capacity of the learned
σ, and at most ``H/2 · log(1 + 1/floor²)`` nats per token. ε (``cut_dp``) is
that of the Gaussian mechanism at the floor, per row.

The bottleneck is A's: its centre, bound and ρ are trained and saved with
A's checkpoint (``private.safetensors``), never sent.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from aisyn.validate import check_number

#: ρ at the start: σ begins a hair above the floor (softplus(-4) ≈ 0.018)
RHO_START = -4.0


@dataclass(frozen=True)
class BottleneckSpec:
    """``--bottleneck-floor`` and ``--bottleneck-beta``: the least noise (in
    units of a full-norm token per coordinate) and the weight of the
    capacity term in A's loss."""

    floor: float
    beta: float = 0.01  # VFLAIR-LLM's default weight of its MID term

    def __post_init__(self) -> None:
        check_number("--bottleneck-floor", self.floor, low=0, low_open=True)
        check_number("--bottleneck-beta", self.beta, low=0)

    def to_dict(self) -> dict:
        return asdict(self)


class Bottleneck(nn.Module):
    """The bottleneck of one run (``spec``) over activations of up to
    ``seq_len`` positions of ``hidden`` coordinates. ``centre`` and
    ``radius`` are set by ``calibrate`` (or loaded with the checkpoint)."""

    def __init__(self, spec: BottleneckSpec, seq_len: int, hidden: int) -> None:
        super().__init__()
        self.spec = spec
        self.register_buffer("centre", torch.zeros(seq_len, hidden))
        self.register_buffer("radius", torch.ones(()))
        self.rho = nn.Parameter(torch.full((hidden,), RHO_START))

    def sigma(self) -> torch.Tensor:
        """The noise of each coordinate, in units of ``R / √H``: ≥ the floor."""
        return self.spec.floor + F.softplus(self.rho)

    def forward(
        self, h: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(what A sends for ``h`` (B, T, H), ``β · C``: A's training term)."""
        T, H = h.shape[1], h.shape[2]
        centre = self.centre[:T].to(h.dtype)
        z = h - centre
        # per token: at most R, and never scaled up
        scale = (self.radius / z.norm(dim=-1, keepdim=True).clamp_min(1e-12)).clamp(
            max=1.0
        )
        z = z * scale
        unit = self.radius / math.sqrt(H)
        sigma = self.sigma().to(h.dtype)
        noise = torch.randn(h.shape, generator=generator, dtype=h.dtype)
        sent = centre + z + noise.to(h.device) * (sigma * unit)
        power = (z / unit).pow(2).flatten(0, 1).mean(0)  # P_i over the tokens
        capacity = 0.5 * torch.log1p(power / sigma.pow(2)).sum()
        return sent, self.spec.beta * capacity

    @torch.no_grad()
    def calibrate(self, outputs: torch.Tensor) -> None:
        """``centre`` and ``radius`` from the front's outputs (N, T, H) on
        public text: the mean at each position, the median centred norm."""
        T = outputs.shape[1]
        # positions past the public rows' (a longer generation) take the mean
        self.centre.copy_(outputs.mean((0, 1)).expand_as(self.centre))
        self.centre[:T] = outputs.mean(0)
        norms = (outputs - self.centre[:T]).norm(dim=-1)
        self.radius.fill_(float(norms.median()))

    @torch.no_grad()
    def capacity_bound(self) -> float:
        """Nats per token that can cross at most, whatever the front sends
        within the clip: the water-filling capacity of the learned σ under
        total power H (``Σ_i P_i ≤ H``)."""
        return water_filling(self.sigma().double().pow(2), float(len(self.rho)))

    def record(self) -> dict:
        """What a run reports of it (``privacy.json``)."""
        s = self.sigma().detach()
        H = len(s)
        return {
            "radius": float(self.radius),
            "sigma_min": float(s.min()),
            "sigma_mean": float(s.mean()),
            "sigma_max": float(s.max()),
            "capacity_bound_nats_per_token": self.capacity_bound(),
            "capacity_at_floor_nats_per_token": H
            / 2
            * math.log1p(1 / self.spec.floor**2),
        }


def water_filling(noise_var: torch.Tensor, power: float) -> float:
    """The capacity (nats) of parallel Gaussian channels of ``noise_var``
    under a total ``power``: ``Σ ½ log(1 + P_i / N_i)`` at the best
    ``P_i = max(0, ν - N_i)``, ``Σ P_i = power``."""
    n = noise_var.sort().values
    k = torch.arange(1, len(n) + 1, dtype=n.dtype)
    # the water level if the k quietest channels are filled
    levels = (power + n.cumsum(0)) / k
    filled = int((levels > n).sum())  # levels > n holds for a prefix
    level = levels[filled - 1]
    return float(0.5 * torch.log(level / n[:filled]).sum())
