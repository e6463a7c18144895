"""Activation checkpointing, applied to a model's blocks from outside.

``checkpoint_blocks`` puts torch's composable ``checkpoint`` on every
attention layer a model (or one party's part of it) holds: the ordinary blocks
and the head's own layers (PanGu-α's top query layer). Each then keeps only
its input in forward and recomputes the rest in backward, under the autocast
state its forward had. The hooks leave the module tree and every parameter
name as they were (unlike a wrapper module), so checkpoints, LoRA, the
optimizer's names and the split's module paths are unchanged; the model files
know nothing of it (torchtitan's ``apply_ac``, without its wrapper).
Recomputation runs the same kernels on the same inputs, so the losses and
gradients are those of the run without it.
"""

from __future__ import annotations

from torch import nn
from torch.distributed._composable import checkpoint

from aisyn.model.causal_lm import Layout


def checkpoint_blocks(model: nn.Module, layout: Layout) -> list[str]:
    """Checkpoint each of ``layout``'s layers present in ``model``; returns
    their paths."""
    done = []
    for i in range(layout.num_layers):
        path = layout.block_path(i)
        try:
            block = model.get_submodule(path)
        except AttributeError:
            continue  # another party's block (a split model holds only its own)
        checkpoint(block)
        done.append(path)
    return done
