"""The comparison's scorer: every model's cloze accuracy on each domain's test
items and its LM loss on each domain's raw test text, the items encoded once
for all the models; and its cache by the weights scored."""

from __future__ import annotations

import hashlib
import json
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
from aisyn.train.run import write_json_atomic
from aisyn.validate import read_json


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


class ScoreCache:
    """``evaluate`` remembered by the weights it scored, in ``folder`` (one
    JSON file a model and format): a resumed table scores each finished run
    once, not again at every restart -- on a CPU a full score of the
    reference's model takes minutes, and a seed has eighteen. The scores of
    the same weights are the same (the items, the text and the scorer are
    the recipe's), so the cache only saves time."""

    def __init__(self, evaluate: Evaluator, folder: Path) -> None:
        self.evaluate, self.folder = evaluate, folder
        self.accuracy = evaluate.accuracy  # per-round scores: not cached

    def __call__(self, model: CausalLM, fmt: str) -> dict:
        path = self.folder / f"{weights_digest(model, fmt)}.json"
        if path.is_file():
            try:
                return read_json(path)
            except ValueError:  # a torn or foreign file: score afresh
                pass
        scores = self.evaluate(model, fmt)
        self.folder.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, json.loads(json.dumps(scores)))
        return scores


def weights_digest(model: torch.nn.Module, *extra: str) -> str:
    """SHA-256 of a model's named tensors (names, dtypes, shapes, bytes) and
    ``extra``."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # no copy
    for e in extra:
        h.update(f"|{e}".encode())
    return h.hexdigest()
