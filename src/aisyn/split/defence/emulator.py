"""The data party's local stand-in for the compute party's frozen middle.

Under ``--backbone frozen`` no gradient crosses the cut: B runs its blocks
forward only, and A trains its back blocks and head exactly on B's real
output. A's front blocks sit *before* B, so their gradient would have to come
back through B's middle; instead A sends it through a cheap copy of that
middle it builds itself from the public base -- an *emulator*, as
Offsite-Tuning (arXiv 2302.04870) calls its layer-dropped copy of a frozen
model's middle.

How A builds it: ``blocks`` of the ``m`` middle blocks B runs, uniformly
spaced (the first and the last always among them when ``blocks`` >= 2),
with the public base's weights, frozen and in eval mode. ``blocks=0`` is the
identity: the front's gradient is then the gradient of B's output, passed
straight through (the residual stream's own share of the true Jacobian).
Offsite-Tuning also distils its emulator towards the full middle; this one is
the plain layer-drop (no training, nothing learned from A's data).

The emulator is used for the backward pass only: the loss is always computed
on B's real output, so the back blocks and the head get their exact
gradient; only the front's is an estimate (``DataSession``).
"""

from __future__ import annotations

import torch
from torch import nn

from aisyn.model.causal_lm import CausalLM
from aisyn.model.families import ModelConfig, build_model
from aisyn.model.segments import COMPUTE_PARTY, Partition, own_tensor_shapes
from aisyn.train import checkpoint as ckpt

#: the emulator's default depth: Offsite-Tuning's emulators keep a fraction
#: of the middle; two blocks hold the first and the last of B's
DEFAULT_BLOCKS = 2
#: how A's front learns under a frozen backbone: through the emulator, or not
FRONT_VIA = ("emulator", "frozen")


def emulated_blocks(middle: range, blocks: int) -> list[int]:
    """``blocks`` indices of ``middle``, uniformly spaced, first and last
    included (all of them if ``blocks`` >= ``len(middle)``)."""
    if blocks < 0:
        raise ValueError(f"--emulator-blocks {blocks}: must be >= 0")
    m = len(middle)
    if blocks >= m:
        return list(middle)
    if blocks == 0:
        return []
    if blocks == 1:
        return [middle[m // 2]]
    return [middle[round(j * (m - 1) / (blocks - 1))] for j in range(blocks)]


class Emulator(nn.Module):
    """A frozen copy of some of B's middle blocks, run on A's device.

    ``forward(x, attn_mask, position_ids)`` maps front-cut activations
    (B, T, C) to an estimate of B's output, with the ops of ``CausalLM.block``
    (so the same masks and positions as the real middle).
    """

    def __init__(self, model: CausalLM, indices: list[int]) -> None:
        super().__init__()
        self.model = model  # only the emulated blocks are materialised
        self.indices = indices

    @classmethod
    def from_base(
        cls,
        base: str,
        cfg: ModelConfig,
        partition: Partition,
        blocks: int,
        device: torch.device,
    ) -> Emulator:
        """The emulator of ``partition``'s middle with ``blocks`` of its
        blocks, read from the base model file ``base`` (only those tensors)."""
        (middle,) = [s.blocks for s in partition.stages_of(COMPUTE_PARTY)]
        indices = emulated_blocks(middle, blocks)
        model = build_model(cfg, device="meta")
        paths = [cfg.layout.block_path(i) for i in indices]
        prefixes = tuple(p + "." for p in paths)
        for path in paths:
            model.get_submodule(path).to_empty(device=device)
        # B's tensors of the base (what a checkpoint holds), those blocks'
        shapes = {
            n: s
            for n, s in own_tensor_shapes(cfg, partition, COMPUTE_PARTY).items()
            if n.startswith(prefixes)
        }
        whose = f"the emulator of blocks {indices} needs"
        tensors = ckpt.read_some_tensors(ckpt.model_file(base), shapes, whose)
        ckpt.load_exactly(
            {n: t for n, t in model.state_dict().items() if n.startswith(prefixes)},
            tensors,
            str(base),
            "the emulator's blocks",
        )
        model.requires_grad_(False).eval()
        return cls(model, indices)

    def train(self, mode: bool = True) -> Emulator:
        # Always eval: it stands in for a frozen middle (no dropout).
        return super().train(False)

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not self.indices:
            return x
        m = self.model
        ctx = m.context(x.shape[1], attn_mask, position_ids, x.device)
        for i in self.indices:
            x = m.block(i, x, ctx)
        return x

    def extra_repr(self) -> str:
        return f"blocks={self.indices}"
