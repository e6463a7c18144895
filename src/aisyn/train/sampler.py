"""Deterministic, resumable order over the samples of one or more shard sets.

Several data folders (e.g. two domains for data fusion) form one index space in
the order given; each epoch is a fresh permutation drawn from ``seed + epoch``,
so the order depends only on (seed, position), never on wall-clock or workers,
and a run resumed from ``state_dict()`` sees exactly the batches it would have.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from aisyn.data.shards import TokenShards


class BatchSampler:
    def __init__(self, sources: Sequence[TokenShards], seed: int) -> None:
        if not sources:
            raise ValueError("no data to sample from")
        self.sources = list(sources)
        self.sizes = [len(s) for s in self.sources]
        self.total = sum(self.sizes)
        if self.total == 0:
            names = ", ".join(str(s.data_dir) for s in self.sources)
            raise ValueError(f"{names}: the {self.sources[0].split!r} split is empty")
        self.offsets = np.cumsum([0, *self.sizes])
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.total, generator=g)

    def next_indices(self, n: int) -> torch.Tensor:
        """The next ``n`` global sample indices, rolling over epochs."""
        out = []
        while n > 0:
            take = min(n, self.total - self.position)
            out.append(self._perm[self.position : self.position + take])
            self.position += take
            n -= take
            if self.position == self.total:
                self.epoch += 1
                self.position = 0
                self._perm = self._permutation(self.epoch)
        return torch.cat(out)

    def fetch(self, indices: torch.Tensor) -> torch.Tensor:
        """Samples for global indices, as one (n, seq_len+1) int64 tensor."""
        idx = indices.numpy()
        src = np.searchsorted(self.offsets, idx, side="right") - 1
        rows = torch.empty(
            len(idx), self.sources[0].manifest["sample_len"], dtype=torch.int64
        )
        for s in np.unique(src):
            sel = np.nonzero(src == s)[0]
            rows[sel] = self.sources[s].batch(idx[sel] - self.offsets[s])
        return rows

    def next_batch(self, n: int) -> torch.Tensor:
        return self.fetch(self.next_indices(n))

    def state_dict(self) -> dict:
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "sizes": self.sizes,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["sizes"] != self.sizes or state["seed"] != self.seed:
            raise ValueError(
                "data changed since the checkpoint was written "
                f"(sizes {state['sizes']} -> {self.sizes}, "
                f"seed {state['seed']} -> {self.seed}); cannot resume exactly"
            )
        self.epoch, self.position = state["epoch"], state["position"]
        self._perm = self._permutation(self.epoch)
