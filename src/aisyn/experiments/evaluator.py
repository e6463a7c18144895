"""The comparison's scorer: every model's cloze accuracy on each domain's test
items and its LM loss on each domain's raw test text, the items encoded once
for all the models."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aisyn.data.sft import SFTData
from aisyn.data.shards import TokenShards
from aisyn.data.tokenizer import PanguTokenizer
from aisyn.eval.cloze import encode_items, encoded_accuracy
from aisyn.model.causal_lm import CausalLM
from aisyn.train.objective import evaluate_loss


@dataclass
class Evaluator:
    """Scores models on every domain's test items and test text; encodes once."""

    domains: Sequence[str]
    sft: dict[str, Path]
    shards: dict[str, Path]
    tok: PanguTokenizer
    seq_len: int
    max_items: int | None
    device: torch.device
    _encoded: dict = field(default_factory=dict)

    def encoded(self, domain: str, fmt: str):
        if (domain, fmt) not in self._encoded:
            items = SFTData.open(self.sft[domain], "train", verify=False).test_items()
            items = items[: self.max_items] if self.max_items else items
            self._encoded[domain, fmt] = encode_items(
                items, self.tok, self.seq_len, fmt
            )
        return self._encoded[domain, fmt]

    def accuracy(self, model: CausalLM, fmt: str) -> dict:
        """Cloze accuracy on every domain's test items, by domain."""
        model = model.to(self.device).eval()
        return {
            d: encoded_accuracy(
                model,
                self.encoded(d, fmt),
                fmt=fmt,
                pad_id=self.tok.pad_id,
                device=self.device,
            )
            for d in self.domains
        }

    def __call__(self, model: CausalLM, fmt: str) -> dict:
        out: dict = {"format": fmt}
        for d, acc in self.accuracy(model, fmt).items():
            out[f"acc_{d}"] = acc
            test = TokenShards.open(self.shards[d], "test", verify=False)
            out[f"loss_{d}"] = evaluate_loss(
                model, test, batch_size=16, device=self.device
            )
        return out
